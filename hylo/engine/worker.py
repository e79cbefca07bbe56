"""The plain worker: turns a scheduled step into a ForwardBatch, runs the model, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.attention import AttentionBackend
from ..backends.gdn import GDNBackend
from ..backends.hybrid import HybridBackend
from ..backends.mamba2 import Mamba2Backend
from ..cache.memory import Caches
from ..cache.req_slots import SAMPLING_INTS
from ..core import ForwardBatch, ForwardMode, SamplingBatch, host_tensor_to, to_device
from ..models.causal_lm import CausalLM
from ..ops.logits import apply_penalties, token_logprobs
from ..ops.sampling import sample
from ..ops.triton_utils import use_triton
from .extend import ExtendPack, expand, sampling_ints
from .graphs import GraphRunner
from .plan import ScheduledBatch


@dataclass
class StepResult:
    """Tokens of one step's sampling rows, on the device: ``tokens[i, :counts[i]]`` are row i's new tokens
    (``counts`` None means one each); ``logprobs`` [S, W, 1 + 2N] float32 when some row asked for them: each
    token's log probability, then the N most likely ids' log probabilities, then those ids (exact in float32)."""

    tokens: torch.Tensor  # [S, W] int64
    counts: torch.Tensor | None = None  # [S] int64
    packed: torch.Tensor | None = None  # [S, W + 1]: tokens then counts, when the step wrote them as one tensor
    logprobs: torch.Tensor | None = None
    # prompt log probabilities of the EXTEND rows that asked for them, [P, 2 + 2N] (``ModelWorker.prompt_logprobs``)
    prompt_logprobs: torch.Tensor | None = None

    @classmethod
    def from_packed(cls, packed: torch.Tensor) -> "StepResult":
        return cls(packed[:, :-1], packed[:, -1], packed)

    def host_view(self) -> torch.Tensor:
        """What the host reads back, as one int64 tensor: the tokens, the counts in an extra column (when there
        are), the log probabilities' float32 bits after them (when there are)."""
        if self.packed is not None:
            view = self.packed
        else:
            view = self.tokens if self.counts is None else torch.cat([self.tokens, self.counts[:, None]], dim=1)
        if self.logprobs is None:
            return view
        bits = self.logprobs.contiguous().view(torch.int32).to(torch.int64).view(view.shape[0], -1)
        return torch.cat([view, bits], dim=1)


def all_greedy(reqs) -> bool:
    """Whether every request decodes greedily (temperature 0) with nothing else to do with its logits: no
    penalty, bias or constraint changes them and none asks for log probabilities (the graphs' greedy token is then
    final)."""
    return all(r.params.temperature == 0 and not r.params.penalized and r.params.logprobs is None
               and r.automaton is None for r in reqs)


def pack_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> torch.Tensor:
    """[B, W, 1 + 2N] float32: the tokens' log probabilities under the raw ``logits`` [B * W, V], the top N."""
    rows, width = tokens.shape
    chosen, ids, vals = token_logprobs(logits.reshape(rows * width, -1), tokens.reshape(-1), top_n)
    return torch.cat([chosen[:, None], vals, ids.float()], dim=1).view(rows, width, 1 + 2 * top_n)


class ModelWorker:
    def __init__(self, model: CausalLM, caches: Caches, device: torch.device, extra_attn_layers: int = 0,
                 vocab_size: int | None = None, eos_ids=()):
        self.model = model
        self.caches = caches
        self.device = device
        self.vocab_size = vocab_size or model.config.vocab_size  # the whole vocabulary (logits are gathered)
        linear = (Mamba2Backend(caches.state_pool) if model.config.mamba is not None
                  else GDNBackend(caches.state_pool))
        self.backend = HybridBackend(AttentionBackend(caches.kv_pool, caches.req_slots), linear,
                                     model.config.layer_types, extra_attn_layers)
        self.graphs: GraphRunner | None = None
        # the model's stop ids (min_tokens masks them; the verify's acceptance limit), on the device too
        self.eos_ids: set[int] = set(eos_ids)
        self.eos_tensor = torch.tensor(sorted(self.eos_ids), dtype=torch.int64, device=device)

    def build_batch(self, sched: ScheduledBatch, input_ids: torch.Tensor | None = None,
                    drafts: torch.Tensor | None = None) -> ForwardBatch:
        """Host plan -> device batch. Records the step's newly reserved KV locations in ``req_to_token`` and reads
        the fed tokens' locations back from it on the device.

        Rows the scheduler marked ``from_device`` (decoding rows) take their newest token, and when every row is
        one, their positions too, from the device tables: the host may not know them yet (overlap loop).
        Verify rows feed their newest token and then their drafts, ``drafts[req_slot]`` (a device table).
        ``input_ids`` overrides the fed tokens altogether."""
        slots, dev = self.caches.req_slots, self.device
        max_seq_len = max(p + n for p, n in zip(sched.prefix_lens, sched.extend_lens))
        if all(sched.from_device):  # DECODE / TARGET_VERIFY: everything comes from the device tables
            slots.write_locations(sched.kv_triples())
            req_slots, state_slots = host_tensor_to(  # one copy for both
                [[r.req_slot for r in sched.reqs], [r.state_slot for r in sched.reqs]], dev)
            return self.table_batch(sched.mode, sched.extend_lens[0], req_slots, state_slots, max_seq_len, drafts,
                                    input_ids)
        # EXTEND: prefill chunks, known to the host, and decoding rows riding along (plain decoding only), which
        # feed one token at a position the host knows exactly, the token itself from the device table. One copy
        # of everything the host knows, expanded per token on the device (engine/extend.py).
        assert all(n == 1 and not r.inflight_verify
                   for r, n, d in zip(sched.reqs, sched.extend_lens, sched.from_device) if d)
        register = sched.admitted  # their sampling parameters go into the device table now
        self.register_penalties(register)
        self.register_constraints(register)
        pack = ExtendPack.build(sched, register, self.vocab_size)
        meta = to_device(pack.meta, dev)
        v = pack.views(meta)
        if register:
            slots.write_sampling_rows(v["reg_slots"], v["reg_floats"].view(torch.float32).view(-1, 2),
                                      v["reg_ints"].view(-1, SAMPLING_INTS))
        ids, positions, locs, token_rows, seq_lens = expand(pack, meta, slots.req_to_token, slots.last_token)
        batch = ForwardBatch(
            mode=sched.mode,
            input_ids=ids if input_ids is None else input_ids,
            positions=positions,
            req_slots=v["req"],
            state_slots=v["state"],
            seq_lens=seq_lens,
            query_start_loc=v["qsl"],
            out_cache_loc=locs,
            max_seq_len=max_seq_len,
            extend_lens_cpu=list(sched.extend_lens),
            prefix_lens_cpu=list(sched.prefix_lens),
            req_slots_cpu=[r.req_slot for r in sched.reqs],
            state_slots_cpu=[r.state_slot for r in sched.reqs],
            generated_rows_cpu=list(sched.generated),
            token_rows=token_rows,
            sample_idx=v["sample_idx"],
            sample_rows=v["sample_rows"],
        )
        return batch

    def table_batch(self, mode: ForwardMode, n: int, req_slots: torch.Tensor, state_slots: torch.Tensor,
                    max_seq_len: int, drafts: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                    kv: torch.Tensor | None = None) -> ForwardBatch:
        """A batch of decoding rows (``n`` tokens each) built on the device from the rows' slots alone: positions
        from the committed lengths, the newest token (then the drafts ``drafts[req_slot]``), the KV locations from
        ``req_to_token``, after writing the new ones ``kv`` [3, W] (request slots, positions, locations) into it.
        This is the prologue of the staged graphs too, where a padded row (request slot 0) reads as an empty row:
        length n, positions from 0, KV at the dummy location (slot 0's ``req_to_token`` row). One Triton launch on
        the GPU (``ops.tables_triton``); the torch form below is its reference."""
        slots, dev = self.caches.req_slots, self.device
        if use_triton(req_slots):
            from ..ops.tables_triton import table_batch

            ids, positions, locs, seq_lens, qsl = table_batch(slots.req_to_token, slots.seq_len, slots.last_token,
                                                              req_slots, n, drafts, kv)
            return ForwardBatch(mode=mode, input_ids=ids if input_ids is None else input_ids, positions=positions,
                                req_slots=req_slots, state_slots=state_slots, seq_lens=seq_lens,
                                query_start_loc=qsl, out_cache_loc=locs, max_seq_len=max_seq_len, tokens_per_row=n)
        if kv is not None:
            slots.scatter_locations(*kv)
        base = slots.seq_len[req_slots].masked_fill(req_slots == 0, 0)
        pos2d = base[:, None] + torch.arange(n, device=dev)[None, :]
        if input_ids is None:
            input_ids = slots.last_token[req_slots][:, None]
            if drafts is not None:
                input_ids = torch.cat([input_ids, drafts[req_slots]], dim=1)
            input_ids = input_ids.reshape(-1)
        return ForwardBatch(
            mode=mode,
            input_ids=input_ids,
            positions=pos2d.reshape(-1),
            req_slots=req_slots,
            state_slots=state_slots,
            seq_lens=base + n,
            query_start_loc=torch.arange(req_slots.shape[0] + 1, device=dev) * n,
            out_cache_loc=slots.req_to_token[req_slots[:, None], pos2d].reshape(-1),
            max_seq_len=max_seq_len,
            tokens_per_row=n,
        )

    def capture_staged(self, name: str, mode: ForwardMode, n: int, fn, drafts: torch.Tensor | None = None) -> None:
        """Capture ``fn`` as a staged graph (graphs.py) over decoding rows of ``n`` tokens, whose prologue writes the
        step's new KV locations and gathers the batch from the request tables (``table_batch``)."""
        max_context = self.graphs.max_context

        def prologue(req_slots, state_slots, kv):
            return self.table_batch(mode, n, req_slots, state_slots, max_context, drafts, kv=kv)
        # a decoding row reserves at most n new locations per step in the steady state; room for twice that
        self.graphs.capture_staged(name, n, prologue, fn, kv_per_row=2 * n)

    def run_staged(self, name: str, sched: ScheduledBatch) -> tuple[dict[str, torch.Tensor], ForwardBatch]:
        """Replay the staged graph ``name`` for a step of decoding rows: the host stages their slots and new KV
        locations (one copy) and the graph does the rest. Returns its outputs and its batch, for the real rows."""
        kv = sched.kv_triples()
        if kv is not None and kv.shape[1] > self.graphs.kv_capacity(name, len(sched.reqs)):
            self.caches.req_slots.write_locations(kv)  # more than the stage carries: written before the replay
            kv = None
        return self.graphs.run_staged(name, [r.req_slot for r in sched.reqs], [r.state_slot for r in sched.reqs], kv)

    def register_sampling(self, reqs) -> None:
        """Write these requests' sampling parameters into the device table (when their prefill starts)."""
        if not reqs:
            return
        self.caches.req_slots.write_sampling(
            [r.req_slot for r in reqs], [(float(r.params.temperature), float(r.params.top_p)) for r in reqs],
            [sampling_ints(r, self.vocab_size) for r in reqs])

    def sampling_batch(self, sched: ScheduledBatch, batch: ForwardBatch, rows: torch.Tensor | None = None,
                       reqs=None) -> SamplingBatch:
        """Sampling parameters of the sampling rows (``rows``: their batch rows; None: every row), gathered from
        the device table. The index of the output token each row samples comes from the device lengths:
        seq_len - prompt_len at the row's first sampled position (the host's output count lags one step behind
        in the overlap loop). The flags that pick which work runs at all come from the host."""
        reqs = sched.reqs if reqs is None else reqs
        slots = batch.req_slots if rows is None else batch.req_slots[rows]
        table = self.caches.req_slots
        f, i = table.sampling_f[slots], table.sampling_i[slots]
        seq_lens = batch.seq_lens if rows is None else batch.seq_lens[rows]
        greedy = [r.params.is_greedy for r in reqs]
        v = self.vocab_size
        wanted = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
        return SamplingBatch(
            temperatures=f[:, 0], top_p=f[:, 1], top_k=i[:, 0], seeds=i[:, 1],
            steps=seq_lens - (batch.tokens_per_row - 1) - i[:, 2],
            all_greedy=all(greedy), any_greedy=any(greedy),
            need_top_k=any(0 < r.params.top_k < v for r, g in zip(reqs, greedy) if not g),
            need_top_p=any(r.params.top_p < 1.0 for r, g in zip(reqs, greedy) if not g),
            slots=slots, penalized=any(r.params.penalized for r in reqs), logprobs=max(wanted, default=None),
            constrained=any(r.automaton is not None for r in reqs))

    def choose(self, logits: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next token of each row ([B]) from its logits [B, V]: penalties and bias first where a row has them
        (counting the token it picks), then the constraints' masks where a row has one (moving its state on by the
        token), then greedy or a seeded draw; and the log probabilities of the raw logits where a row asked for
        them ([B, 1, 1 + 2N], else None)."""
        tables = self.caches.req_slots.penalties
        processed = apply_penalties(logits, tables, sb.slots, sb.steps) if sb.penalized else logits
        if sb.constrained:
            constraints = self.caches.req_slots.constraints
            states = constraints.state[sb.slots]
            processed = constraints.mask_logits(processed, states, sb.slots)
        tokens = sample(processed, sb)
        if sb.constrained:
            constraints.advance(sb.slots, states, tokens)
        if sb.penalized:
            tables.count(sb.slots, tokens[:, None])
        lp = pack_logprobs(logits, tokens[:, None], sb.logprobs) if sb.logprobs is not None else None
        return tokens, lp

    def prompt_logprobs(self, sched: ScheduledBatch, hidden: torch.Tensor) -> torch.Tensor | None:
        """For the prefill rows whose requests asked for prompt log probabilities: at every fed position that is
        followed by another prompt token, that token's log probability, the top N and the token's rank in the
        vocabulary ([P, 1 + 2N + 1] in row order, ``ScheduledBatch.prompt_logprob_spans`` says which rows and
        positions). None
        when no row asked."""
        spans = sched.prompt_logprob_spans()
        if not spans:
            return None
        top_n = max(sched.reqs[i].params.prompt_logprobs for i, _, _ in spans)
        starts = [sum(sched.extend_lens[:i]) for i in range(len(sched.reqs))]
        idx = torch.cat([torch.arange(starts[i], starts[i] + n) for i, _, n in spans])
        targets = torch.cat([sched.reqs[i].token_tensor(p + 1, p + 1 + n) for i, p, n in spans])
        dev_idx = to_device(torch.stack([idx, targets]), self.device)
        logits = self.model.compute_logits(hidden[dev_idx[0]])
        # rank 1 + the tokens more likely than the prompt's (exact in float32 up to 2 ** 24 tokens)
        rank = (logits > logits.gather(1, dev_idx[1][:, None])).sum(1, keepdim=True) + 1
        return torch.cat([pack_logprobs(logits, dev_idx[1][:, None], top_n)[:, 0], rank.float()], 1)

    def register_constraints(self, reqs) -> None:
        """The constraint states of requests whose prefill starts (their automaton's start; -1 without one, so a
        reused slot forgets its last request's), once any request had a constraint."""
        if self.caches.req_slots.constraints is None and all(r.automaton is None for r in reqs):
            return
        tables = self.caches.req_slots.ensure_constraints(self.vocab_size, self.eos_ids)
        for r in reqs:
            tables.register(r.req_slot, r.automaton, r.output_ids)

    def register_penalties(self, reqs) -> None:
        """The rows of the penalty tables (allocated when a request first changes its logits), written when a
        request's prefill starts: every request's once the tables exist, not only the penalized ones'. A step with
        a penalized row applies the tables to all its rows, so the others' must be neutral (zero bias, repetition
        1), not a never-written row or one left by the slot's earlier request (one request's logit_bias would
        change another's greedy tokens in the same batch)."""
        tables = self.caches.req_slots.penalties
        if tables is None:
            if not any(r.params.penalized for r in reqs):
                return
            tables = self.caches.req_slots.ensure_penalties(self.vocab_size)
        for r in reqs:
            stops = set(r.params.stop_token_ids or ()) | (set() if r.params.ignore_eos else self.eos_ids)
            tables.register(r.req_slot, r.prompt_ids, r.output_ids, r.params, stops)

    def capture_graphs(self, capture_sizes: list[int], verbose: bool = True) -> None:
        """Capture the DECODE pass at these batch sizes: the model forward, the LM head, and the greedy token of
        every row recorded in the request tables (a step whose rows are all greedy launches nothing else; one with
        sampling rows records its drawn tokens over them)."""
        self.graphs = GraphRunner(self.backend, self.device, capture_sizes, self.caches.req_slots.max_context,
                                  verbose)
        model, backend = self.model, self.backend

        def decode(batch, extras):
            logits = model.compute_logits(model(batch, backend))
            return {"logits": logits, "greedy": self.greedy_record(logits, batch)}
        self.capture_staged("decode", ForwardMode.DECODE, 1, decode)

    def greedy_record(self, logits: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every row's greedy token, recorded in the request tables with the rows' new lengths (``ReqSlots.record``;
        one launch with the argmax on the GPU, ``ops.tables_triton``). Returns the tokens [B]."""
        tables = self.caches.req_slots
        if not use_triton(logits):
            greedy = logits.argmax(-1)
            tables.record(batch.req_slots, batch.seq_lens, batch.req_slots, greedy)
            return greedy
        from ..ops.tables_triton import greedy_record

        return greedy_record(logits, batch.req_slots, batch.seq_lens, tables.last_token, tables.seq_len)

    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.init_forward_metadata(batch)
        return self.model(batch, self.backend)

    @torch.inference_mode()
    def run(self, sched: ScheduledBatch) -> StepResult:
        """Launches one step; returns the sampled token of every sampling row (on the device) and records the new
        lengths and tokens in the request tables."""
        if sched.mode is ForwardMode.DECODE and self.graphs is not None and self.graphs.can_run("decode",
                                                                                                 len(sched.reqs)):
            out, batch = self.run_staged("decode", sched)  # records the greedy tokens and the new lengths itself
            if all_greedy(sched.reqs):
                return StepResult(out["greedy"][:, None])
            tokens, lp = self.choose(out["logits"], self.sampling_batch(sched, batch))
            self.caches.req_slots.record(batch.req_slots, batch.seq_lens, batch.req_slots, tokens)
            return StepResult(tokens[:, None], logprobs=lp)
        batch = self.build_batch(sched)
        hidden = self.forward_hidden(batch)
        prompt_lp = self.prompt_logprobs(sched, hidden) if batch.mode is ForwardMode.EXTEND else None
        sampled = [r for r, keep in zip(sched.reqs, sched.sample) if keep]
        if batch.mode is ForwardMode.DECODE:
            last, rows = hidden, None
        else:
            last, rows = hidden[batch.sample_idx], batch.sample_rows
        if not sampled:
            self.caches.req_slots.record(batch.req_slots, batch.seq_lens)
            return StepResult(torch.empty(0, 1, dtype=torch.int64, device=self.device), prompt_logprobs=prompt_lp)
        logits = self.model.compute_logits(last)
        tokens, lp = self.choose(logits, self.sampling_batch(sched, batch, rows, sampled))
        self.caches.req_slots.record(batch.req_slots, batch.seq_lens,
                                     batch.req_slots if rows is None else batch.req_slots[rows], tokens)
        return StepResult(tokens[:, None], logprobs=lp, prompt_logprobs=prompt_lp)
