"""CUDA graphs for the fixed-shape passes (DECODE, TARGET_VERIFY, and the MTP head's DRAFT_EXTEND / DRAFT_DECODE),
captured at a list of batch sizes and replayed with padding.

At replay a batch of ``raw_bs`` rows is padded to the next captured size ``bs``. The runner knows
``num_padding = bs - raw_bs`` on the host for free and passes it in the batch to the backends' replay hook, which
marks the padded tail (request slot 0, state slot -1, a dummy KV location, a fill length). Nothing on this path
reads sequence lengths back from the device to find the padding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..core import ForwardBatch, ForwardMode


def default_capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 64, 8)) + list(range(64, 256, 32)) + list(range(256, 1025, 64))
    out = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return out


@dataclass
class _Static:
    """The static buffers one captured pass reads: sized for the largest batch, sliced per captured size."""

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
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    outputs: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def view(self, bs: int, num_padding: int, max_seq_len: int) -> ForwardBatch:
        n = bs * self.tokens_per_row
        return ForwardBatch(
            mode=self.mode, input_ids=self.input_ids[:n], positions=self.positions[:n],
            req_slots=self.req_slots[:bs], state_slots=self.state_slots[:bs], seq_lens=self.seq_lens[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], out_cache_loc=self.out_cache_loc[:n],
            max_seq_len=max_seq_len, num_padding=num_padding, tokens_per_row=self.tokens_per_row)


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
        self.passes: dict[str, _Static] = {}
        self.fns: dict[str, Callable] = {}

    def padded_size(self, raw_bs: int) -> int | None:
        for s in self.sizes:
            if s >= raw_bs:
                return s
        return None

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
        self.passes[name] = st
        self.fns[name] = fn
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(dev)[0]
        sizes = list(reversed(self.sizes))
        for bs in tqdm(sizes, desc=f"capturing {name}", disable=not self.verbose, leave=False):
            batch = st.view(bs, 0, self.max_context)  # capture uses num_padding = 0
            ex = {k: v[:bs * tokens_per_row] for k, v in st.extras.items()}
            self.backend.init_forward_metadata_capture(bs, mode)
            fn(batch, ex)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn(batch, ex)
            if self.pool is None:
                self.pool = graph.pool()
            st.graphs[bs] = graph
            st.outputs[bs] = out
        torch.cuda.synchronize(dev)
        if self.verbose:
            used = (free0 - torch.cuda.mem_get_info(dev)[0]) / (1 << 20)
            print(f"[hylo] captured {name} graphs for batch sizes {self.sizes} in {time.perf_counter() - t0:.1f}s "
                  f"({used:.0f} MiB)", flush=True)

    def can_run(self, name: str, raw_bs: int) -> bool:
        return name in self.passes and raw_bs <= self.max_bs

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
        st.graphs[bs].replay()
        # outputs are per token ([bs * tokens_per_row, ...]) or, when tokens_per_row > 1, may be per row ([bs, ...])
        return {k: v[:raw_bs] if s > 1 and v.shape[0] == bs else v[:n] for k, v in st.outputs[bs].items()}
