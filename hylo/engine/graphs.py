"""CUDA graphs for the fixed-shape passes (DECODE, TARGET_VERIFY, and the MTP head's DRAFT_EXTEND / DRAFT_DECODE;
the speculative worker's whole steps: ``spec_step``, and the plain steps of its adaptive policy), captured at a list
of batch sizes and replayed with padding.

At replay a batch of ``raw_bs`` rows is padded to the next captured size ``bs``; the runner knows
``num_padding = bs - raw_bs`` on the host for free. Nothing on this path reads sequence lengths back from the
device to find the padding. A pass gets its inputs in one of two ways:

- copied (``capture`` / ``run``): the host builds the whole ForwardBatch, the runner copies it into the static
  buffers and passes ``num_padding`` to the backends' replay hook, which marks the padded tail (request slot 0,
  state slot -1, a dummy KV location, a fill length). The verify pass of n-gram or sampled rows and the MTP head's
  own passes work this way.
- staged (``capture_staged`` / ``run_staged``): the steady-state steps, plain decode and the fused speculative step.
  The host stages only the rows' request and state slots, padded from ``num_padding`` (request slot 0, state slot
  -1), and the step's new KV locations: one copy to the device. The captured graph begins with a prologue that
  writes the KV locations and gathers everything else from the device request tables, so a step costs the host
  one copy and one replay. A padded row reads as an empty row of request slot 0 (see ``ReqSlots``): its length is
  the fill length and its KV locations are the dummy location, with no per-replay marking at all.

Off CUDA (the CPU tests of the runner itself) a "graph" is the pass re-run at every replay on the same static
buffers, so the staging and padding logic is tested without a GPU.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..core import ForwardBatch, ForwardMode, pin
from ..progress import progress


def default_capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 64, 8)) + list(range(64, 256, 32)) + list(range(256, 1025, 64))
    out = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return out


class _Replay:
    """One captured size of a pass: ``replay()`` runs it, after which ``outputs`` (and for a staged pass, ``batch``,
    the batch its prologue built) hold its results. On CUDA a graph; elsewhere the pass itself, re-run."""

    def __init__(self, run: Callable, device: torch.device, pool):
        self._run = run
        self.graph = None
        if device.type == "cuda":
            run()  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.batch, self.outputs = run()
        else:
            self.batch, self.outputs = run()

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.batch, self.outputs = self._run()


@dataclass
class _Static:
    """The static buffers one copied pass reads: sized for the largest batch, sliced per captured size."""

    tokens_per_row: int
    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_slots: torch.Tensor
    state_slots: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    extras: dict[str, torch.Tensor]  # per token
    replays: dict[int, _Replay] = field(default_factory=dict)

    def view(self, bs: int, num_padding: int, max_seq_len: int) -> ForwardBatch:
        n = bs * self.tokens_per_row
        return ForwardBatch(
            mode=self.mode, input_ids=self.input_ids[:n], positions=self.positions[:n],
            req_slots=self.req_slots[:bs], state_slots=self.state_slots[:bs], seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], out_cache_loc=self.out_cache_loc[:n],
            max_seq_len=max_seq_len, num_padding=num_padding, tokens_per_row=self.tokens_per_row)


@dataclass
class _Staged:
    """The one int64 buffer a staged pass reads. At captured size ``bs`` it holds, in order: the rows' request slots
    [bs], their state slots [bs], and the new KV locations as (request slot, position, location) triples [3, bs * w]
    (``w = kv_per_row``; unused triples are (0, 0, 0): the padding row's entry, which is the dummy location anyway)."""

    tokens_per_row: int
    kv_per_row: int
    stage: torch.Tensor
    replays: dict[int, _Replay] = field(default_factory=dict)

    def views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = bs * self.kv_per_row
        s = self.stage
        return s[:bs], s[bs:2 * bs], s[2 * bs:2 * bs + 3 * w].view(3, w)

    def host_stage(self, bs: int, req_slots: list[int], state_slots: list[int],
                   kv: torch.Tensor | None) -> torch.Tensor:
        """The host side of the stage at captured size ``bs``, the padded tail marked: request slot 0, state slot -1."""
        pad, w = bs - len(req_slots), bs * self.kv_per_row
        host = torch.zeros(2 * bs + 3 * w, dtype=torch.int64)
        host[:2 * bs] = torch.tensor(req_slots + [0] * pad + state_slots + [-1] * pad, dtype=torch.int64)
        if kv is not None and kv.shape[1]:
            host[2 * bs:].view(3, w)[:, :kv.shape[1]] = kv
        return host


def real_rows(batch: ForwardBatch, raw_bs: int) -> ForwardBatch:
    """A padded fixed-shape batch cut to its first ``raw_bs`` (real) rows."""
    n = raw_bs * batch.tokens_per_row
    return replace(batch, input_ids=batch.input_ids[:n], positions=batch.positions[:n],
                   req_slots=batch.req_slots[:raw_bs], state_slots=batch.state_slots[:raw_bs],
                   seq_lens=batch.seq_lens[:raw_bs], query_start_loc=batch.query_start_loc[:raw_bs + 1],
                   out_cache_loc=batch.out_cache_loc[:n], num_padding=0)


class GraphRunner:
    """Captures named fixed-shape passes ``fn(batch, extras) -> {name: tensor}`` and replays them with padding."""

    def __init__(self, backend, device: torch.device, capture_sizes: list[int], max_context: int,
                 verbose: bool = True):
        self.backend = backend
        self.device = device
        self.sizes = sorted(capture_sizes)
        self.max_bs = self.sizes[-1]
        self.max_context = max_context
        self.verbose = verbose
        self.pool = None
        self.passes: dict[str, _Static | _Staged] = {}

    def padded_size(self, raw_bs: int) -> int | None:
        for s in self.sizes:
            if s >= raw_bs:
                return s
        return None

    def can_run(self, name: str, raw_bs: int) -> bool:
        return name in self.passes and raw_bs <= self.max_bs

    def _capture_all(self, name: str, st, make_run: Callable[[int], Callable]) -> None:
        """Capture ``make_run(bs)`` at every size, largest first (the smaller ones reuse its memory pool)."""
        self.passes[name] = st
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        # No garbage collection inside a capture: a collected cycle that holds an older engine's graphs destroys
        # them mid-capture, a call CUDA forbids while a stream captures, and the capture fails. Collect once
        # before, then keep the collector off until every size is captured.
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            for bs in progress(list(reversed(self.sizes)), f"capturing {name}", enabled=self.verbose,
                               unit="sizes"):
                st.replays[bs] = _Replay(make_run(bs), self.device, self.pool)
                if cuda and self.pool is None:
                    self.pool = st.replays[bs].graph.pool()
        finally:
            if gc_was_on:
                gc.enable()
        if cuda:
            torch.cuda.synchronize(self.device)
        if self.verbose:
            used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / (1 << 20) if cuda else 0.0
            print(f"[hylo] captured {name} graphs for batch sizes {self.sizes} in {time.perf_counter() - t0:.1f}s "
                  f"({used:.0f} MiB)", flush=True)

    # ---- copied passes ------------------------------------------------------------------------------------------
    def capture(self, name: str, mode: ForwardMode, tokens_per_row: int, fn: Callable,
                extras: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> None:
        """Capture ``fn`` at every size. ``extras``: more static inputs, as (shape per token, dtype). ``fn``
        returns tensors per token ([bs * tokens_per_row, ...]) or, with several tokens per row, per row."""
        dev, n, mb = self.device, self.max_bs * tokens_per_row, self.max_bs
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        st = _Static(tokens_per_row, mode, z(n), z(n), z(n), z(mb), torch.full((mb,), -1, dtype=torch.int64,
                     device=dev), torch.full((mb,), tokens_per_row, dtype=torch.int64, device=dev),
                     torch.arange(mb + 1, device=dev) * tokens_per_row,
                     {k: torch.zeros(n, *shape, dtype=dtype, device=dev) for k, (shape, dtype) in (extras or {}).items()})

        def make_run(bs):
            batch = st.view(bs, 0, self.max_context)  # capture uses num_padding = 0
            extras = {k: v[:bs * tokens_per_row] for k, v in st.extras.items()}
            return lambda: (None, fn(batch, extras))
        self._capture_all(name, st, make_run)

    def run(self, name: str, batch: ForwardBatch, extras: dict[str, torch.Tensor] | None = None):
        """Copy the batch into the static buffers, let the backends mark the padded tail, replay.
        Returns the outputs for the real rows."""
        st = self.passes[name]
        raw_bs = batch.batch_size
        bs = self.padded_size(raw_bs)
        s = st.tokens_per_row
        n = raw_bs * s
        st.input_ids[:n].copy_(batch.input_ids)
        st.positions[:n].copy_(batch.positions)
        st.out_cache_loc[:n].copy_(batch.out_cache_loc)
        st.req_slots[:raw_bs].copy_(batch.req_slots)
        st.state_slots[:raw_bs].copy_(batch.state_slots)
        st.seq_lens[:raw_bs].copy_(batch.seq_lens)
        for k, v in (extras or {}).items():
            st.extras[k][:n].copy_(v)
        view = st.view(bs, bs - raw_bs, batch.max_seq_len)
        self.backend.init_forward_metadata_replay(view)
        rep = st.replays[bs]
        rep.replay()
        return _real_outputs(rep.outputs, raw_bs, bs, s)

    # ---- staged passes ------------------------------------------------------------------------------------------
    def capture_staged(self, name: str, tokens_per_row: int,
                       prologue: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], ForwardBatch], fn: Callable,
                       kv_per_row: int) -> None:
        """Capture ``fn(prologue(req_slots, state_slots, kv_triples), {})`` at every size; the prologue builds the
        batch on the device from the staged slots (see the module docstring). ``kv_per_row``: room for this many new
        KV locations per row in the stage (a step that reserves more writes them before the replay)."""
        mb = self.max_bs
        stage = torch.zeros(2 * mb + 3 * mb * kv_per_row, dtype=torch.int64, device=self.device)
        st = _Staged(tokens_per_row, kv_per_row, stage)

        def make_run(bs):
            req_slots, state_slots, kv = st.views(bs)
            stage.zero_()  # every row padding (request slot 0, state slot -1), every KV triple (0, 0, 0)
            state_slots.fill_(-1)

            def run():
                batch = prologue(req_slots, state_slots, kv)
                return batch, fn(batch, {})
            return run
        self._capture_all(name, st, make_run)

    def kv_capacity(self, name: str, raw_bs: int) -> int:
        """How many new KV locations the stage of pass ``name`` carries at this batch size."""
        return self.padded_size(raw_bs) * self.passes[name].kv_per_row

    def run_staged(self, name: str, req_slots: list[int], state_slots: list[int],
                   kv: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], ForwardBatch]:
        """Stage the rows' slots, padded, and the new KV locations (``kv`` [3, W]: request slots, positions,
        locations; W at most ``kv_capacity``), in one copy to the device, then replay. Returns the outputs and the
        batch the prologue built, for the real rows."""
        st = self.passes[name]
        raw_bs = len(req_slots)
        bs = self.padded_size(raw_bs)
        host = st.host_stage(bs, req_slots, state_slots, kv)
        st.stage[:host.shape[0]].copy_(pin(host) if st.stage.is_cuda else host, non_blocking=True)
        rep = st.replays[bs]
        rep.replay()
        return _real_outputs(rep.outputs, raw_bs, bs, st.tokens_per_row), real_rows(rep.batch, raw_bs)


def _real_outputs(outputs: dict[str, torch.Tensor], raw_bs: int, bs: int, s: int) -> dict[str, torch.Tensor]:
    """Outputs are per token ([bs * tokens_per_row, ...]) or, when tokens_per_row > 1, may be per row ([bs, ...])."""
    return {k: v[:raw_bs] if s > 1 and v.shape[0] == bs else v[:raw_bs * s] for k, v in outputs.items()}
