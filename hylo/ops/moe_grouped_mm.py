"""The routed experts of a large prefill chunk through torch's grouped GEMM (``torch._grouped_mm``: CUTLASS on
Hopper and later), which runs the expert matmuls at tile sizes our Triton grouped kernel cannot hold.

Pairs (token, expert) are sorted by expert on the device (a counting sort in three launches), their token rows
gathered, and each expert's rows multiplied by its weights in one launch per projection; the group boundaries
are a device tensor, so nothing here waits for the host. Around the two GEMMs only two Triton passes remain:
``silu(gate) * up`` of the sorted rows, and, at the end, each token's weighted sum of its k down-projected rows,
gathered from the sorted order (the un-sort and the reduction in one read; an ``index_copy`` back to pair order
alone took 0.55 ms per layer on the H200 at 8192 tokens, more than both GEMMs' share of the routing overhead).
The result is one float32 row per token, [T, 1, H], which the residual add takes like any unreduced rows.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .pair_rows import SortedPairRows
from .triton_utils import env_cfg, env_flag, env_int

# below this many pairs the Triton grouped kernel (tuned for decode batches, graph-captured) is used;
# HYLO_GROUPED_MM_MIN_PAIRS moves the threshold (a huge value keeps every chunk on the Triton kernel)
GROUPED_MM_MIN_PAIRS = env_int("HYLO_GROUPED_MM_MIN_PAIRS", 4096, minimum=0)


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] in (9, 10)


def grouped_mm_usable(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, num_pairs: int) -> bool:
    """Whether this MoE call should run through ``torch._grouped_mm``: many pairs, 16-bit weights, a Hopper or
    Blackwell GPU, and rows whose byte strides keep CUTLASS's 16-byte alignment."""
    if num_pairs < GROUPED_MM_MIN_PAIRS or not x.is_cuda or not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    hidden, inter = x.shape[1], w2.shape[-1]
    return hidden % 8 == 0 and inter % 8 == 0 and _device_supports(x.device.index or 0)


@triton.jit
def _act_kernel(h_ptr, act_ptr, P, I: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr, GATED: tl.constexpr):
    """Rows [BR] of h [P, 2I] (gate | up) -> silu(gate) * up [P, I], or with GATED=False of h [P, I] (up) ->
    relu(up)^2; in float32, rounded once."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BI)
    m = (rows < P)[:, None] & (cols < I)[None, :]
    UP0: tl.constexpr = I if GATED else 0
    base = rows.to(tl.int64)[:, None] * (UP0 + I) + cols[None, :]
    u = tl.load(h_ptr + base + UP0, mask=m, other=0.0).to(tl.float32)
    if GATED:
        g = tl.load(h_ptr + base, mask=m, other=0.0).to(tl.float32)
        act = g / (1.0 + tl.exp(-g)) * u
    else:
        r = tl.maximum(u, 0.0)
        act = r * r
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gather_rows_kernel(x_ptr, tok_ptr, out_ptr, P, H: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """Program (block of BR sorted rows, block of BH columns): out[r] = x[tok[r]]."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mr = rows < P
    m = mr[:, None] & (cols < H)[None, :]
    src = tl.load(tok_ptr + rows, mask=mr, other=0)
    v = tl.load(x_ptr + src[:, None] * H + cols[None, :], mask=m)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], v, mask=m)


@triton.jit
def _scatter_rows_kernel(x_ptr, pos_ptr, out_ptr, T, H: tl.constexpr, TOP_K: tl.constexpr, BT: tl.constexpr,
                         BH: tl.constexpr):
    """Program (block of BT tokens, block of BH columns): each token's row is read once and written to the sorted
    rows of its TOP_K pairs, out[pos[t * TOP_K + j]] = x[t]. The same rows as the gather by ``tok``, but x is read
    in order: the gather reads each token's row TOP_K times in expert order, and an 8192-token chunk's 335 MB of
    sorted rows stream through L2 between those reads."""
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mt = toks < T
    m = mt[:, None] & (cols < H)[None, :]
    v = tl.load(x_ptr + toks.to(tl.int64)[:, None] * H + cols[None, :], mask=m)
    for j in tl.static_range(TOP_K):
        row = tl.load(pos_ptr + toks * TOP_K + j, mask=mt, other=0).to(tl.int64)
        tl.store(out_ptr + row[:, None] * H + cols[None, :], v, mask=m)


# the pair rows gathered by the Triton kernel above instead of torch's index_select: 105.6 against 142.8 us per
# layer at an 8192-token bench-6b chunk on the H200, floor 94.1 (tune_kernels --only gather,
# tune-fma-20261204-0501.json, with the rows' tokens in ascending order); in the prefill itself, with the rows in
# expert order, it took 148 us a layer (profile-prefill-20261204-1745). HYLO_GATHER_ROWS=0 goes back to
# index_select; HYLO_SCATTER_ROWS=0 keeps the gather instead of the scatter by pair (``scatter_rows``)
GATHER_ROWS = env_flag("HYLO_GATHER_ROWS", True)
SCATTER_ROWS = env_flag("HYLO_SCATTER_ROWS", True)
SCATTER_ROWS_CFG = env_cfg("HYLO_SCATTER_ROWS_CFG", (2, 4))  # tokens a program (of a 2048-wide row), warps


def scatter_rows(x: torch.Tensor, pos: torch.Tensor, top_k: int, cfg: tuple[int, int] | None = None) -> torch.Tensor:
    """The expert-sorted pair rows from each pair's sorted row: out[pos[t * top_k + j]] = x[t], for x [T, H]
    contiguous and pos [T * top_k] a permutation of the pairs (as ``sort_pairs_by_expert`` returns it); equal to
    ``gather_rows(x, tok)`` with that sort's ``tok``."""
    tokens, hidden = x.shape
    out = torch.empty(pos.numel(), hidden, dtype=x.dtype, device=x.device)
    if tokens:
        per_2048, warps = cfg or SCATTER_ROWS_CFG
        bh = min(2048, triton.next_power_of_2(hidden))
        bt = triton.next_power_of_2(max(1, per_2048 * 2048 // bh))
        _scatter_rows_kernel[(triton.cdiv(tokens, bt), triton.cdiv(hidden, bh))](x, pos, out, tokens, hidden,
                                                                                 TOP_K=top_k, BT=bt, BH=bh,
                                                                                 num_warps=warps)
    return out


def sorted_rows(x: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor, top_k: int,
                mode: str | None = None) -> torch.Tensor:
    """The MoE's pair rows in expert order: ``mode`` "scatter" (by pair, the default), "gather" (by sorted row) or
    "torch" (``index_select``); None: the settings above."""
    if mode is None:
        mode = ("scatter" if SCATTER_ROWS else "gather") if GATHER_ROWS else "torch"
    if mode == "scatter":
        return scatter_rows(x, pos, top_k)
    if mode not in ("gather", "torch"):
        raise ValueError(f"sorted_rows: mode {mode!r} is not 'scatter', 'gather' or 'torch'")
    return gather_rows(x, tok, triton_kernel=mode == "gather")


def gather_rows(x: torch.Tensor, tok: torch.Tensor, triton_kernel: bool | None = None) -> torch.Tensor:
    """x[tok] for x [T, H] contiguous, tok [P] int64 (every entry a valid row)."""
    if not (GATHER_ROWS if triton_kernel is None else triton_kernel):
        return x.index_select(0, tok)
    rows, hidden = tok.numel(), x.shape[1]
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    if rows:
        bh = min(2048, triton.next_power_of_2(hidden))
        br = max(1, 8192 // bh)
        _gather_rows_kernel[(triton.cdiv(rows, br), triton.cdiv(hidden, bh))](x, tok, out, rows, hidden, BR=br,
                                                                               BH=bh, num_warps=8)
    return out


@triton.jit
def _expert_hist_kernel(ids_ptr, hist_ptr, P, NC, BP: tl.constexpr, BE: tl.constexpr):
    """Program c: the histogram of experts over pairs [c * BP, (c + 1) * BP) -> hist[:, c] (expert-major, so that
    the scan reads each expert's counts contiguously)."""
    c = tl.program_id(0)
    offs = c * BP + tl.arange(0, BP)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=0).to(tl.int32)
    tl.store(hist_ptr + tl.arange(0, BE) * NC + c, tl.histogram(ids, BE, mask=offs < P))


@triton.jit
def _expert_scan_kernel(hist_ptr, base_ptr, totals_ptr, NC, BC: tl.constexpr):
    """Program e: within expert e's sorted rows, chunk c's pairs come after those of chunks < c; base[e, c] is
    where they start, counted from the expert's first row, and totals[e] is the expert's pair count. One program
    per expert, each a 1-D scan of its contiguous counts: the single program that scanned the [chunks, experts]
    table column by column took 52 us a layer on the H200 and 76 on the H100 at an 8192-token prefill (704
    chunks). (A ``while`` loop: Triton's interpreter cannot run a for loop with run-time bounds.)"""
    e = tl.program_id(0)
    row = hist_ptr + e.to(tl.int64) * NC
    running = tl.zeros([], dtype=tl.int32)
    c0 = 0
    while c0 < NC:
        offs = c0 + tl.arange(0, BC)
        h = tl.load(row + offs, mask=offs < NC, other=0)
        tl.store(base_ptr + e.to(tl.int64) * NC + offs, running + tl.cumsum(h, 0) - h, mask=offs < NC)
        running += tl.sum(h, 0)
        c0 += BC
    tl.store(totals_ptr + e, running)


@triton.jit
def _expert_scatter_kernel(ids_ptr, base_ptr, totals_ptr, ends_ptr, pos_ptr, tok_ptr, P, NC, E,
                           TOP_K: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """Program c: each of its pairs goes to its expert's next row, in pair order: pos[pair] = that row, and
    tok[row] = the pair's token (pair // TOP_K). An expert's rows start after all pairs of experts < e (the
    exclusive sum of totals, which every program forms from the E counts; program 0 also stores the inclusive sum
    as ``ends``)."""
    c = tl.program_id(0)
    offs_e = tl.arange(0, BE)
    totals = tl.load(totals_ptr + offs_e, mask=offs_e < E, other=0)
    ends = tl.cumsum(totals, 0)
    if c == 0:
        tl.store(ends_ptr + offs_e, ends, mask=offs_e < E)
    first = ends - totals + tl.load(base_ptr + offs_e * NC + c, mask=offs_e < E, other=0)
    offs = c * BP + tl.arange(0, BP)
    m = offs < P
    ids = tl.load(ids_ptr + offs, mask=m, other=BE).to(tl.int32)  # past the end: no expert's column
    # the expert's first row for this chunk, plus the earlier pairs of the chunk with the same expert (counted by
    # comparing pairs: two reductions along rows, where a running count down the [pairs, experts] one-hot is a
    # scan across the program's warps)
    row = tl.sum(tl.where(ids[:, None] == offs_e[None, :], first[None, :], 0), 1)
    i = tl.arange(0, BP)
    earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
    row += tl.sum(earlier.to(tl.int32), 1)
    tl.store(pos_ptr + offs, row.to(tl.int64), mask=m)
    tl.store(tok_ptr + row, (offs // TOP_K).to(tl.int64), mask=m)


SORT_CHUNK = 128  # pairs per program of the counting sort
SCAN_BLOCK = 1024  # chunks per block of an expert's scan (131072 pairs: one block up to a 13107-token top-10 chunk)
SORT_MAX_EXPERTS = 255  # beyond, a chunk's [pairs, experts] one-hot no longer fits a program's registers


def sort_pairs_by_expert(flat_ids: torch.Tensor, num_experts: int, top_k: int):
    """A stable counting sort of the (token, expert) pairs by expert, in three launches (``argsort`` with the
    inverse permutation and the group ends took about fifteen: cub's radix sort alone is eight, plus memsets).
    flat_ids: [P] (pair j is token j // top_k's). Returns (pos [P] int64: each pair's row in the sorted order,
    tok [P] int64: the token of each sorted row, ends [E] int32: where each expert's rows end). Models with more
    experts than SORT_MAX_EXPERTS (Qwen3-Next-80B has 512) sort with torch's argsort instead."""
    num_pairs, dev = flat_ids.numel(), flat_ids.device
    if num_experts > SORT_MAX_EXPERTS:
        return _sort_pairs_torch(flat_ids, num_experts, top_k)
    be = max(16, triton.next_power_of_2(num_experts + 1))  # + 1: a column no expert owns, for masked pairs
    chunks = triton.cdiv(num_pairs, SORT_CHUNK)
    hist = torch.empty(be, chunks, dtype=torch.int32, device=dev)
    base = torch.empty_like(hist)
    totals = torch.empty(num_experts, dtype=torch.int32, device=dev)
    ends = torch.empty(num_experts, dtype=torch.int32, device=dev)
    pos = torch.empty(num_pairs, dtype=torch.int64, device=dev)
    tok = torch.empty(num_pairs, dtype=torch.int64, device=dev)
    if num_pairs == 0:
        return pos, tok, ends.zero_()
    _expert_hist_kernel[(chunks,)](flat_ids, hist, num_pairs, chunks, BP=SORT_CHUNK, BE=be, num_warps=4)
    _expert_scan_kernel[(num_experts,)](hist, base, totals, chunks, BC=SCAN_BLOCK, num_warps=4)
    _expert_scatter_kernel[(chunks,)](flat_ids, base, totals, ends, pos, tok, num_pairs, chunks, num_experts,
                                      TOP_K=top_k, BP=SORT_CHUNK, BE=be, num_warps=8)
    return pos, tok, ends


def _sort_pairs_torch(flat_ids: torch.Tensor, num_experts: int, top_k: int):
    """:func:`sort_pairs_by_expert` through torch's stable argsort (for many experts)."""
    order = flat_ids.argsort(stable=True)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat_ids.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))  # not bincount: it reads the maximum back
    ends = counts.cumsum(0, dtype=torch.int32)
    return pos, order // top_k, ends


def fused_moe_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, reduce: bool = True, gated: bool = True) -> "torch.Tensor | SortedPairRows":
    """x: [T, H]; w13: [E, 2I, H] (or [E, I, H] with ``gated=False``: squared-ReLU experts); w2: [E, H, I]; topk_*: [T, k]. Returns each token's weighted sum of its experts'
    outputs as one float32 row, [T, 1, H]; with ``reduce=False`` the rows before those sums
    (:class:`ops.pair_rows.SortedPairRows`), which the residual add that follows sums as it reads them."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[-1]
    flat = topk_ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    # pairs grouped by expert: pos = each pair's sorted row, tok = each sorted row's token, and group g holds the
    # sorted rows [ends[g-1], ends[g])
    pos, tok, ends = sort_pairs_by_expert(flat, num_experts, top_k)
    xs = sorted_rows(x.contiguous(), pos, tok, top_k)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)  # [P, 2I] (gated) or [P, I]
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    br, bi = 16, triton.next_power_of_2(inter)
    _act_kernel[(triton.cdiv(num_pairs, br),)](h, act, num_pairs, inter, BR=br, BI=bi, GATED=gated,
                                               num_warps=4 if bi <= 512 else 8)
    del h
    ys = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)  # [P, H], sorted order, unweighted
    pairs = SortedPairRows(ys, pos, topk_weights.reshape(-1).contiguous(), top_k)
    return pairs.reduce() if reduce else pairs
