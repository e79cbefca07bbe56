"""The speculative worker: prefill + first drafts, or verify + accept + commit + next drafts, in one step.

It has the plain worker's interface (``run(sched) -> StepResult``), so the engine drives both the same way. The
committed linear-attention state is never touched by a verify pass: the backend keeps what the verify needs in its
verify buffers (the step's inputs, or a state checkpoint after every position), and the commit brings each row's
slot to its last accepted token (``GDNBackend.commit_verified``: the kept inputs replayed, or a checkpoint copied).

Where the drafts do not pay (engine/spec_policy.py) a step decodes one token per row as the plain worker does, and
the drafter keeps up with it (``after_decode``: the n-gram history, the MTP head's KV of the new position), drafting
at the step's end only when the next step is to verify.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core import ForwardMode, host_tensor_to
from ..engine.plan import ScheduledBatch
from ..engine.graphs import GraphRunner
from ..engine.worker import ModelWorker, StepResult, all_greedy, pack_logprobs
from ..ops.logits import apply_penalties, verify_extra_counts
from ..ops.sampling import greedy_tokens, uniform_noise
from ..ops.triton_utils import use_triton
from .verify import accept_limit, coupled_accept, greedy_accept, inert_rows, per_position, verify_tokens


STREAM_SIMULATE = 4  # noise stream of the benchmark's simulated acceptance (0: ops/sampling's draws)


class SpecWorker:
    def __init__(self, target: ModelWorker, drafter, k: int, simulate_accept_length: float | None = None,
                 seed: int = 0, plain_steps: bool = True):
        self.target = target
        self.drafter = drafter
        self.k = k
        self.plain_steps = plain_steps  # the policy may run plain decode steps (graphs for them are captured)
        # the simulated target lives on the device, per request slot: the captured step reads it at every replay,
        # so that it can be changed between measurements (a Python float would be baked into the graph at capture)
        self._sim_len = simulate_accept_length
        self._sim_want = torch.zeros(target.caches.req_slots.seq_len.shape[0], dtype=torch.float32,
                                     device=target.device)
        if simulate_accept_length is not None:
            self.simulate_accept_length = simulate_accept_length
        self._sim_seed = seed
        # test hook: fn(reqs, drafts [B, k], first output index [B]) -> drafts, to force acceptance or rejection
        self.draft_hook = None

    @property
    def simulate_accept_length(self) -> float | None:
        return self._sim_len

    @simulate_accept_length.setter
    def simulate_accept_length(self, value: float | None) -> None:
        if (value is None) != (self._sim_len is None):
            raise ValueError("simulated acceptance is chosen when the engine is built (simulate_accept_length); "
                             "only its value can change afterwards")
        self._sim_len = value
        self._sim_want.fill_(self._drafts_wanted(value))

    def _drafts_wanted(self, accept_length: float) -> float:
        """The mean accepted drafts of a simulated accept length (tokens per verify, the bonus included)."""
        return min(max(accept_length - 1.0, 0.0), float(self.k))

    def simulate_rows(self, req_slots: list[int], accept_length: float) -> None:
        """Benchmarks: a simulated accept length of its own for each of these request slots (a mixed batch)."""
        if self._sim_len is None:
            raise ValueError("simulated acceptance is chosen when the engine is built (simulate_accept_length)")
        self._sim_want[torch.tensor(req_slots, device=self._sim_want.device)] = self._drafts_wanted(accept_length)

    def capture_graphs(self, capture_sizes: list[int], verbose: bool = True) -> None:
        """Capture TARGET_VERIFY (k + 1 tokens per row) and, for the MTP drafter, its DRAFT_EXTEND (k + 1 per row)
        and DRAFT_DECODE (1 per row) passes, and the whole greedy verify step (``spec_step``: verify, acceptance,
        commit, table updates and the next drafts), at these batch sizes."""
        tw = self.target
        graphs = GraphRunner(tw.backend, tw.device, capture_sizes, tw.caches.req_slots.max_context, verbose)
        tw.graphs = graphs
        model, backend = tw.model, tw.backend

        def verify(batch, extras):
            hidden = model(batch, backend)
            return {"hidden": hidden, "logits": model.compute_logits(hidden)}

        graphs.capture("verify", ForwardMode.TARGET_VERIFY, self.k + 1, verify)
        fn = self.drafter.graph_fn(backend)
        if fn is not None:
            hidden = ((model.config.hidden_size,), model.dtype)
            graphs.capture("draft_extend", ForwardMode.DRAFT_EXTEND, self.k + 1, fn, {"hidden": hidden})
            if self.k > 1:
                graphs.capture("draft_decode", ForwardMode.DRAFT_DECODE, 1, fn, {"hidden": hidden})
        if self._fused_drafter():
            # a whole verify step of greedy rows, the next drafts included, in one replay
            tw.capture_staged("spec_step", ForwardMode.TARGET_VERIFY, self.k + 1, self._greedy_step,
                              self.drafter.drafts)
        if self.plain_steps:
            # plain steps: the forward (sampled rows), and whole greedy steps with the drafter's bookkeeping
            graphs.capture("plain", ForwardMode.DECODE, 1, verify)
            tw.capture_staged("plain_step", ForwardMode.DECODE, 1, lambda b, e: self._greedy_plain(b, False))
            tw.capture_staged("plain_draft", ForwardMode.DECODE, 1, lambda b, e: self._greedy_plain(b, True))

    @property
    def backend(self):
        return self.target.backend

    @property
    def caches(self):
        return self.target.caches

    @torch.inference_mode()
    def run(self, sched: ScheduledBatch) -> StepResult:
        if sched.mode is ForwardMode.TARGET_VERIFY:
            return self._verify(sched)
        if sched.mode is ForwardMode.DECODE:
            return self._decode(sched)
        return self._prefill(sched)

    def _forward(self, graph: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's hidden states and logits over ``batch``: the captured pass ``graph`` where one fits."""
        tw = self.target
        if tw.graphs is not None and tw.graphs.can_run(graph, batch.batch_size):
            out = tw.graphs.run(graph, batch)
            return out["hidden"], out["logits"]
        hidden = tw.forward_hidden(batch)
        return hidden, tw.model.compute_logits(hidden)

    def _greedy_plain(self, batch, draft: bool) -> dict[str, torch.Tensor]:
        """A plain decode step of greedy rows with the drafter's part (drafts for the next step when ``draft``),
        all on the device: what the staged graphs ``plain_step`` / ``plain_draft`` run."""
        tw = self.target
        hidden = tw.model(batch, tw.backend)
        greedy = tw.greedy_record(tw.model.compute_logits(hidden), batch)
        self.drafter.after_decode(tw, batch, hidden, greedy, None, draft, fused=True)
        return {"greedy": greedy}

    def _decode(self, sched: ScheduledBatch) -> StepResult:
        """One token per row, no drafts verified; drafts for the next step when ``sched.draft_after``."""
        tw, bs, draft = self.target, len(sched.reqs), sched.draft_after
        name = "plain_draft" if draft else "plain_step"
        if all_greedy(sched.reqs):
            if tw.graphs is not None and tw.graphs.can_run(name, bs):
                out, _ = tw.run_staged(name, sched)
                return StepResult(out["greedy"][:, None])
            batch = tw.build_batch(sched)
            tw.backend.init_forward_metadata(batch)
            return StepResult(self._greedy_plain(batch, draft)["greedy"][:, None])
        batch = tw.build_batch(sched)
        hidden, logits = self._forward("plain", batch)
        sb = tw.sampling_batch(sched, batch)
        tokens, lp = tw.choose(logits, sb)
        self.caches.req_slots.record(batch.req_slots, batch.seq_lens, batch.req_slots, tokens)
        self.drafter.after_decode(tw, batch, hidden, tokens, sb, draft)
        return StepResult(tokens[:, None], logprobs=lp)

    def _prefill(self, sched: ScheduledBatch) -> StepResult:
        tw = self.target
        if sched.hits:  # prefix-cache hits: their tokens, for a drafter that keeps a history
            self.drafter.fill_history(sched.hits)
        batch = tw.build_batch(sched)
        hidden = tw.forward_hidden(batch)
        ends = (torch.tensor(sched.extend_lens).cumsum(0) - 1).tolist()  # host lists, no device read
        # the token after each fed chunk, for the drafter's pairs: known unless it is being sampled now
        next_host = [0 if keep else req.token_at(prefix + n)
                     for req, n, prefix, keep in zip(sched.reqs, sched.extend_lens, sched.prefix_lens, sched.sample)]
        dev = tw.device
        tok_idx, row_idx = batch.sample_idx, batch.sample_rows  # in the batch's one copy
        sampled_reqs = [r for r, keep in zip(sched.reqs, sched.sample) if keep]
        sb = tw.sampling_batch(sched, batch, row_idx, sampled_reqs)
        lp = None
        if sampled_reqs:
            tokens, lp = tw.choose(tw.model.compute_logits(hidden[tok_idx]), sb)
        else:
            tokens = torch.empty(0, dtype=torch.int64, device=dev)
        tw.caches.req_slots.record(batch.req_slots, batch.seq_lens, batch.req_slots[row_idx], tokens)
        next_ids = batch.input_ids.roll(-1)
        end_vals = host_tensor_to(next_host, dev)
        end_vals[row_idx] = tokens
        next_ids[host_tensor_to(ends, dev)] = end_vals
        max_len = max([p + n for p, n, keep in zip(sched.prefix_lens, sched.extend_lens, sched.sample) if keep],
                      default=1)
        self.drafter.after_prefill(tw, batch, hidden, next_ids, tok_idx, row_idx, sb, max_len)
        return StepResult(tokens[:, None], None, logprobs=lp, prompt_logprobs=tw.prompt_logprobs(sched, hidden))

    def _fused_drafter(self) -> bool:
        """Whether the drafter can run inside the fused greedy step (the MTP head: all on the device)."""
        return self.drafter.fused_greedy

    def _greedy_step(self, batch, extras=None) -> dict[str, torch.Tensor]:
        """A verify step whose rows are all greedy, entirely on the device and fixed-shape, so that it can run as
        one captured graph (``spec_step``) or eagerly: the verify pass, acceptance (simulated when asked), the
        commit of the accepted states, the request tables, and the drafter's next drafts. Returns ``packed``
        ([B, k + 2]): each row's emitted tokens, then its count (accepted + 1; 0 for an inert row), what the host
        reads back."""
        tw, k = self.target, self.k
        bs = batch.batch_size
        hidden = tw.model(batch, tw.backend)
        logits = tw.model.compute_logits(hidden).view(bs, k + 1, -1)
        if use_triton(logits):  # acceptance, tables and the host's packed rows in one launch
            from ..ops.tables_triton import accept_record

            tables = self.caches.req_slots
            forced = self._forced_accepts(batch) if self.simulate_accept_length is not None else None
            emitted, accepted, packed = accept_record(greedy_tokens(logits), batch.input_ids, batch.req_slots,
                                                      batch.seq_lens, tables.last_token, tables.seq_len, forced,
                                                      tables.sampling_i, tw.eos_tensor)
            self.backend.commit_verified(*inert_rows(batch.state_slots, accepted))
            accepted = accepted.clamp(min=0)  # the drafts of an inert row (an ended request) are never read
        else:
            drafts = batch.input_ids.view(bs, k + 1)[:, 1:]
            emitted, accepted = self._commit(batch, drafts, *greedy_accept(drafts, logits))
            # what the host reads back, in one piece: each row's emitted tokens, then its count (accepted + 1)
            packed = torch.cat([emitted, accepted[:, None] + 1], dim=1)
            accepted = accepted.clamp(min=0)
        mtp_batch = replace(batch, mode=ForwardMode.DRAFT_EXTEND, input_ids=emitted.reshape(-1))
        self.drafter.draft_greedy(tw, mtp_batch, hidden, accepted)
        return {"packed": packed}

    def _commit(self, batch, drafts, emitted, accepted):
        """After acceptance (simulated when asked): the accepted states into the slots, the new lengths and newest
        tokens into the request tables. Returns the final (emitted, accepted)."""
        if self.simulate_accept_length is not None:
            emitted, accepted = self._simulate(drafts, emitted, accepted, batch)
        # nothing accepted past the request's end (its max_tokens, its end-of-sequence token); -1: it had ended
        fed = batch.input_ids.view(-1, self.k + 1)[:, 0]
        tables = self.caches.req_slots
        accepted = torch.minimum(accepted, accept_limit(emitted, fed, batch.req_slots, batch.seq_lens,
                                                        tables.sampling_i, self.target.eos_tensor))
        # rows that drafted nothing (n-gram without a match), unless a test or the benchmark's simulation decides
        limit = (self.drafter.draft_limit(batch.req_slots)
                 if self.draft_hook is None and self.simulate_accept_length is None else None)
        if limit is not None:
            accepted = torch.minimum(accepted, torch.where(accepted < 0, accepted, limit))
        slots, kept = inert_rows(batch.state_slots, accepted)
        self.backend.commit_verified(slots, kept)
        rows = torch.arange(accepted.shape[0], device=accepted.device)
        inert = accepted < 0  # an inert row leaves its tables as they were
        lens = torch.where(inert, batch.seq_lens - self.k - 1, batch.seq_lens - self.k + accepted)
        newest = torch.where(inert, tables.last_token[batch.req_slots], emitted[rows, kept])
        tables.record(batch.req_slots, lens, batch.req_slots, newest)
        return emitted, accepted

    def _verify(self, sched: ScheduledBatch) -> StepResult:
        tw, k = self.target, self.k
        bs = len(sched.reqs)
        if self._fused_drafter() and self.draft_hook is None and all_greedy(sched.reqs):
            if tw.graphs is not None and tw.graphs.can_run("spec_step", bs):
                out, _ = tw.run_staged("spec_step", sched)
            else:
                batch = tw.build_batch(sched, drafts=self.drafter.drafts)
                tw.backend.init_forward_metadata(batch)
                out = self._greedy_step(batch)
            return StepResult.from_packed(out["packed"])
        batch = tw.build_batch(sched, drafts=self.drafter.drafts)  # rows feed [newest token, d1..dk]
        drafts = batch.input_ids.view(bs, k + 1)[:, 1:]
        if self.draft_hook is not None:  # it gets each row's output index from the device lengths
            first_out = batch.seq_lens - k - tw.caches.req_slots.sampling_i[batch.req_slots, 2]
            drafts.copy_(self.draft_hook(sched.reqs, drafts.clone(), first_out))
        hidden, logits = self._forward("verify", batch)
        logits = logits.view(bs, k + 1, -1)
        raw = logits
        sb = tw.sampling_batch(sched, batch)
        per_pos = per_position(sb, k + 1)  # position i is output index steps + i: plain decoding's draw there
        flat = logits.reshape(bs * (k + 1), -1)
        tables = tw.caches.req_slots.penalties
        if sb.penalized:  # position i is penalised by the tokens before it, this step's drafts 1..i included
            flat = apply_penalties(flat, tables, per_pos.slots, per_pos.steps,
                                   verify_extra_counts(drafts, flat.shape[-1]).view(bs * (k + 1), -1))
        if sb.constrained:  # position i's mask is the state after drafts 1..i (a draft it does not allow is rejected)
            constraints = tw.caches.req_slots.constraints
            states = constraints.chain(batch.req_slots, drafts)
            flat = constraints.mask_logits(flat, states.reshape(-1))
        emitted, accepted = coupled_accept(drafts, verify_tokens(flat.view(bs, k + 1, -1), per_pos))
        emitted, accepted = self._commit(batch, drafts, emitted, accepted)
        if sb.constrained:  # the state after the accepted drafts and the token after them
            last = accepted.clamp(min=0)[:, None]
            constraints.advance(batch.req_slots, states.gather(1, last)[:, 0], emitted.gather(1, last)[:, 0],
                                keep=accepted >= 0)
        if sb.penalized:
            valid = torch.arange(k + 1, device=emitted.device)[None, :] <= accepted[:, None]
            tables.count(sb.slots, emitted, valid)
        self.drafter.after_verify(tw, batch, hidden, emitted, accepted.clamp(min=0), sb)
        lp = pack_logprobs(raw, emitted, sb.logprobs) if sb.logprobs is not None else None
        return StepResult(emitted, accepted + 1, logprobs=lp)

    def _simulate(self, drafts, emitted, accepted, batch):
        """Force a mean accept length (benchmarks on random weights): a drafts accepted, with a drawn so that
        E[a + 1] equals the target; the emitted tokens are the drafts plus the target's token after them.
        Breaks losslessness on purpose. The draw is keyed by (request slot, length), so it can run in a graph."""
        forced = self._forced_accepts(batch)
        rows = torch.arange(drafts.shape[0], device=drafts.device)
        out = torch.cat([drafts, drafts[:, :1]], dim=1).clone()
        out[rows, forced] = emitted[rows, forced]
        return out, forced

    def _forced_accepts(self, batch) -> torch.Tensor:
        """Each row's simulated accepted count [B]: floor(want) or one more, drawn so that E[a + 1] = the target."""
        want = self._sim_want[batch.req_slots]
        lo = want.floor()
        u = uniform_noise(batch.req_slots + self._sim_seed, batch.seq_lens, 1, STREAM_SIMULATE)[:, 0]
        return (lo.long() + (u < want - lo).long()).clamp(max=self.k)
