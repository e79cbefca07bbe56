"""The plain worker: turns a scheduled step into a ForwardBatch, runs the model, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.attention import AttentionBackend
from ..backends.gdn import GDNBackend
from ..backends.hybrid import HybridBackend
from ..cache.memory import Caches
from ..core import ForwardBatch, ForwardMode, SamplingBatch
from ..models.qwen3_next import Qwen3NextForCausalLM
from ..ops.sampling import sample
from .graphs import GraphRunner
from .scheduler import ScheduledBatch


@dataclass
class StepResult:
    """Tokens of one step's sampling rows, on the device: ``tokens[i, :counts[i]]`` are row i's new tokens
    (``counts`` None means one each)."""

    tokens: torch.Tensor  # [S, W] int64
    counts: torch.Tensor | None = None  # [S] int64


def sampling_rows(sched: ScheduledBatch) -> tuple[list[int], list[int]]:
    """For every row that samples in this step: the index of its last fed token, and the row itself."""
    tok_idx, rows, total = [], [], 0
    for row, (n, keep) in enumerate(zip(sched.extend_lens, sched.sample)):
        total += n
        if keep:
            tok_idx.append(total - 1)
            rows.append(row)
    return tok_idx, rows


def _dev(values, device, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class ModelWorker:
    def __init__(self, model: Qwen3NextForCausalLM, caches: Caches, device: torch.device, extra_attn_layers: int = 0):
        self.model = model
        self.caches = caches
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.backend = HybridBackend(AttentionBackend(caches.kv_pool, caches.req_slots),
                                     GDNBackend(caches.state_pool), model.config.layer_types, extra_attn_layers)
        self.graphs: GraphRunner | None = None

    def build_batch(self, sched: ScheduledBatch, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """Host plan -> device batch. Records the step's newly reserved KV locations in ``req_to_token`` and reads
        the fed tokens' locations back from it on the device. ``input_ids`` overrides the fed tokens (verify rows
        feed drafts that only the device knows)."""
        slots = self.caches.req_slots
        if sched.kv_locs:
            slots.write_locations(sched.kv_rows, sched.kv_cols, torch.cat(sched.kv_locs))
        ids, pos, tok_slots = [], [], []
        qsl = [0]
        for req, n, prefix in zip(sched.reqs, sched.extend_lens, sched.prefix_lens):
            if input_ids is None:
                ids.extend(req.tokens(prefix, prefix + n))
            pos.extend(range(prefix, prefix + n))
            tok_slots.extend([req.req_slot] * n)
            qsl.append(qsl[-1] + n)
        seq_lens = [p + n for p, n in zip(sched.prefix_lens, sched.extend_lens)]
        req_slots = [r.req_slot for r in sched.reqs]
        state_slots = [r.state_slot for r in sched.reqs]
        dev = self.device
        positions = _dev(pos, dev)
        varlen = sched.mode.is_extend
        batch = ForwardBatch(
            mode=sched.mode,
            input_ids=_dev(ids, dev) if input_ids is None else input_ids,
            positions=positions,
            req_slots=_dev(req_slots, dev),
            state_slots=_dev(state_slots, dev),
            seq_lens=_dev(seq_lens, dev),
            query_start_loc=_dev(qsl, dev),
            out_cache_loc=slots.req_to_token[_dev(tok_slots, dev), positions],
            max_seq_len=max(seq_lens),
            extend_lens_cpu=list(sched.extend_lens) if varlen else None,
            prefix_lens_cpu=list(sched.prefix_lens) if varlen else None,
            req_slots_cpu=req_slots if varlen else None,
            state_slots_cpu=state_slots if varlen else None,
            tokens_per_row=1 if varlen else sched.extend_lens[0],
        )
        if self.backend.needs_cpu_seq_lens:
            batch.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        return batch

    def capture_graphs(self, capture_sizes: list[int], verbose: bool = True) -> None:
        """Capture the DECODE pass (model forward and LM head) at these batch sizes."""
        self.graphs = GraphRunner(self.backend, self.device, capture_sizes, self.caches.req_slots.max_context,
                                  verbose)
        model, backend = self.model, self.backend
        self.graphs.capture("decode", ForwardMode.DECODE, 1,
                            lambda b, ex: {"logits": model.compute_logits(model(b, backend))})

    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.init_forward_metadata(batch)
        return self.model(batch, self.backend)

    @torch.inference_mode()
    def run(self, sched: ScheduledBatch) -> StepResult:
        """Runs one step; returns the sampled token of every sampling row."""
        batch = self.build_batch(sched)
        if batch.mode is ForwardMode.DECODE and self.graphs is not None and self.graphs.can_run("decode",
                                                                                                 batch.batch_size):
            logits = self.graphs.run("decode", batch)["logits"]
            sb = SamplingBatch.from_reqs(sched.reqs, self.vocab_size, self.device)
            return StepResult(sample(logits, sb)[:, None])
        hidden = self.forward_hidden(batch)
        if batch.mode is ForwardMode.DECODE:
            last = hidden
        else:
            last = hidden[_dev(sampling_rows(sched)[0], self.device)]
        sampled = [r for r, keep in zip(sched.reqs, sched.sample) if keep]
        if not sampled:
            return StepResult(torch.empty(0, 1, dtype=torch.int64, device=self.device))
        logits = self.model.compute_logits(last)
        return StepResult(sample(logits, SamplingBatch.from_reqs(sampled, self.vocab_size, self.device))[:, None])
