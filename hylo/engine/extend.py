"""The inputs of an EXTEND step (prefill chunks, with plain decoding rows riding along) in one host-to-device copy.

The host knows everything about such a step: the fed tokens of its prefill rows, each row's request slot, prefix
and length, the KV locations the scheduler just reserved (as runs: request slot, first position, locations), the
sampling parameters of requests whose prefill starts, and which rows sample. It packs all of it into one int64
tensor, copies it once, and the device expands it: the new locations written into ``req_to_token``, then every
token's row, position, KV location and input id (``expand``: a torch reference here, two Triton launches on CUDA
in ``ops.tables_triton``).

An 8192-token prefill used to build its per-token index tensors on the host (repeat_interleave, arange, gathers
over 8192 elements) and copy them in about ten pieces: 1.3-1.8 ms before the first kernel on the H200's host,
while the GPU waited.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.triton_utils import use_triton
from .plan import ScheduledBatch, expand_runs

# the packed tensor's fields, in order; each is a flat int64 run of the length the host knows
FIELDS = ("tokens", "locs", "run_slot", "run_first", "run_start", "req", "state", "prefix", "qsl", "dev",
          "sample_idx", "sample_rows", "reg_slots", "reg_ints", "reg_floats")
# the header: tokens T, locations W, runs R, rows B, then each field's offset in FIELDS order (ops.tables_triton)
HEADER = 20


def sampling_ints(req, vocab_size: int) -> tuple[int, ...]:
    """A request's row of ``ReqSlots.sampling_i``: top_k (the vocabulary when off), seed, prompt length,
    max_tokens and whether the end-of-sequence ids stop it (a verify accepts no draft past either)."""
    p = req.params
    return (min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size, req.seed, len(req.prompt_ids), p.max_tokens,
            int(not p.ignore_eos))


@dataclass
class ExtendPack:
    """One EXTEND step's host facts as one int64 tensor ``meta`` and each field's (offset, length) in it."""

    meta: torch.Tensor
    spans: dict[str, tuple[int, int]]

    @classmethod
    def build(cls, sched: ScheduledBatch, register: list, vocab_size: int) -> "ExtendPack":
        """``register``: the requests whose sampling parameters go into the device table in this step."""
        rows = len(sched.reqs)
        lens = sched.extend_lens
        parts: dict[str, torch.Tensor | list] = {}
        # fed tokens: the host's for prefill rows, a placeholder where the row's newest token is on the device
        parts["tokens"] = torch.cat([torch.zeros(n, dtype=torch.int64) if from_dev else req.token_tensor(p, p + n)
                                     for req, n, p, from_dev in zip(sched.reqs, lens, sched.prefix_lens,
                                                                    sched.from_device)])
        # runs of new KV locations: req_to_token[slot, first + j] = locs[run_start + j]
        parts["locs"] = torch.cat(sched.kv_locs).to(torch.int64) if sched.kv_locs else []
        starts, at = [], 0
        for t in sched.kv_locs:
            starts.append(at)
            at += t.numel()
        parts["run_slot"] = [s for s, _ in sched.kv_starts]
        parts["run_first"] = [f for _, f in sched.kv_starts]
        parts["run_start"] = starts + [at]
        parts["req"] = [r.req_slot for r in sched.reqs]
        parts["state"] = [r.state_slot for r in sched.reqs]
        parts["prefix"] = list(sched.prefix_lens)
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        parts["qsl"] = qsl
        parts["dev"] = [int(d) for d in sched.from_device]
        parts["sample_idx"] = [qsl[i + 1] - 1 for i in range(rows) if sched.sample[i]]
        parts["sample_rows"] = [i for i in range(rows) if sched.sample[i]]
        parts["reg_slots"] = [r.req_slot for r in register]
        parts["reg_ints"] = [v for r in register for v in sampling_ints(r, vocab_size)]
        # (temperature, top_p) as float32 pairs, each pair's 8 bytes carried as one int64
        floats = torch.tensor([(float(r.params.temperature), float(r.params.top_p)) for r in register],
                              dtype=torch.float32).reshape(-1, 2)
        parts["reg_floats"] = floats.view(torch.int64).reshape(-1)
        # a header first, read by the kernels (sizes and offsets as data, not as arguments: Triton would compile a
        # variant for each pattern of arguments equal to 1 or divisible by 16)
        spans, pieces, at = {}, [], HEADER
        for name in FIELDS:
            p = parts[name]
            t = p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.int64)
            spans[name] = (at, t.numel())
            pieces.append(t)
            at += t.numel()
        header = [spans["tokens"][1], spans["locs"][1], len(starts), rows] + [spans[f][0] for f in FIELDS]
        assert len(header) <= HEADER
        pieces.insert(0, torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64))
        return cls(torch.cat(pieces), spans)

    def views(self, meta: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields as views of ``meta`` (this pack's tensor, or its copy on the device)."""
        return {name: meta[a:a + n] for name, (a, n) in self.spans.items()}


def expand(pack: ExtendPack, meta: torch.Tensor, req_to_token: torch.Tensor, last_token: torch.Tensor):
    """On the device, from ``meta`` (``pack.meta`` copied there): write the runs of new KV locations into
    ``req_to_token``, then return every token's input id, position, KV location and row ([T] each) and every row's
    length after the step ([B]), all int64."""
    if use_triton(req_to_token):
        from ..ops.tables_triton import extend_tables

        return extend_tables(meta, pack.spans["tokens"][1], pack.spans["locs"][1], pack.spans["req"][1],
                             req_to_token, last_token)
    return expand_ref(pack.views(meta), req_to_token, last_token)


def expand_ref(v: dict[str, torch.Tensor], req_to_token: torch.Tensor, last_token: torch.Tensor):
    """:func:`expand` in torch (the CPU path, and the reference of the Triton kernels)."""
    if v["locs"].numel():
        run, cols = expand_runs(v["run_start"], v["run_first"], v["locs"].numel())
        req_to_token[v["run_slot"][run], cols] = v["locs"]
    row, positions = expand_runs(v["qsl"], v["prefix"], v["tokens"].numel())
    slot = v["req"][row]
    ids = torch.where(v["dev"][row] != 0, last_token[slot], v["tokens"])
    return ids, positions, req_to_token[slot, positions], row, v["prefix"] + v["qsl"].diff()
