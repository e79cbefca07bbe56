"""Mamba2's prefill scan in Triton, split along the sequence so that one long prompt fills the GPU.

A program of the scan holds a [BP, N] block of one head's state in registers and walks its tokens in chunks of BT
(``ops.mamba2.ssd_chunk_scan_ref``'s chunk formulas: the chunk's outputs from C B^T under the decay mask, plus C
times the carried state). One program per (row, head) leaves most of an H100 idle on a single 8192-token prompt
(Nemotron 3 Nano: 64 heads, 64 programs on 132 SMs, each walking 128 chunks: 1.47 ms a layer, a quarter of the
prefill). So rows are cut into segments (a whole number of chunks each) and the recurrence's linearity does the
rest: a segment's final state is ``S_in * exp(sum dt A) + L``, where ``L`` is the state the segment reaches from
zeros. Two launches:

1. ``_segment_state_kernel``: for every segment but the last of its row, ``L`` and the segment's total log decay,
   from zeros (the state update alone: a third of the scan's work).
2. ``_scan_kernel``: every segment at once, each first folding the ``L``s of the segments before it in its row into
   the slot's state (``S = S * exp(decay_j) + L_j``), then scanning its own tokens; the row's last segment writes the
   slot (-1: from zeros, nothing written).

Rows short enough, or batches with rows enough, stay one segment each, and launch 1 launches nothing.
``HYLO_MAMBA2_SEGMENTS=0`` keeps every row whole (the one-pass scan, for A/B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..core import to_device
from .mamba2_triton import _load_head, _softplus
from .triton_utils import env_flag, next_pow2, sm_count

SEGMENTS = env_flag("HYLO_MAMBA2_SEGMENTS", True)
SCAN_CHUNK = 64  # tokens a chunk of the scan (its tl.dot tiles are [SCAN_CHUNK, SCAN_CHUNK])
PROGRAMS_PER_SM = 4  # segments are cut until the scan has about this many programs per SM


@dataclass
class ScanPlan:
    """A varlen prefill's rows cut into segments (built on the host from the rows' lengths, once per batch)."""

    # [S, 6] int32 on the device: row, first token, end token, the row's first segment, 1 if the row's last one,
    # 1 if the row's dt is clamped (a prompt's tokens; not a decoding row riding along)
    table: torch.Tensor
    inner: torch.Tensor  # [I] int32: the segments whose final state a later segment needs (not last of their row)
    num_segments: int
    num_inner: int

    @classmethod
    def build(cls, lens: list[int], device, programs_per_segment: int, chunk: int,
              segment_tokens: int | None = None, unclamped: list[bool] | None = None) -> "ScanPlan":
        """``segment_tokens``: a segment's length (a multiple of ``chunk``); None picks it so that the scan has
        about PROGRAMS_PER_SM programs per SM (``programs_per_segment``: heads x channel blocks). ``unclamped``:
        the rows whose dt the scan leaves unclamped (decoding rows, as the reference's decode step)."""
        if segment_tokens is None:
            segment_tokens = _segment_tokens(lens, torch.device(device), programs_per_segment, chunk)
        assert segment_tokens % chunk == 0
        rows, inner, start = [], [], 0
        for row, n in enumerate(lens):
            first = len(rows)
            cuts = list(range(start, start + n, segment_tokens)) or [start]
            for i, a in enumerate(cuts):
                last = i == len(cuts) - 1
                if not last:
                    inner.append(len(rows))
                rows.append((row, a, start + n if last else a + segment_tokens, first, int(last),
                             int(not (unclamped and unclamped[row]))))
            start += n
        flat = to_device(torch.tensor([v for r in rows for v in r] + inner, dtype=torch.int32), device)
        table = flat[:6 * len(rows)].view(len(rows), 6)
        return cls(table, flat[6 * len(rows):], len(rows), len(inner))


def _segment_tokens(lens: list[int], device: torch.device, programs_per_segment: int, chunk: int) -> int:
    """One length for every row's segments, so that the batch's tokens make about PROGRAMS_PER_SM programs per SM:
    a long row beside short ones is cut as finely as a long row alone (each segment a program's share of the work),
    many rows of moderate length stay whole."""
    longest = max(lens, default=0)
    whole = max(chunk, triton.cdiv(max(longest, 1), chunk) * chunk)
    if not SEGMENTS:
        return whole
    segments = max(1, PROGRAMS_PER_SM * sm_count(device) // programs_per_segment)
    share = triton.cdiv(triton.cdiv(sum(lens), segments), chunk) * chunk
    # at least 4 chunks a segment: a shorter one would spend more on folding states than on its own tokens
    return min(whole, max(4 * chunk, share))


@triton.jit
def _load_chunk(x_ptr, dt_ptr, t0, end, h, offs_p, offs_n, mp, mn, A, bias, dt_min, dt_max, clamp_row, stride_x,
                stride_dt, H: tl.constexpr, N: tl.constexpr, G: tl.constexpr, P: tl.constexpr, INNER: tl.constexpr,
                BT: tl.constexpr, CLAMP: tl.constexpr):
    """Tokens [t0, t0 + BT) clipped at ``end``: dt (softplus of raw + bias, clamped where the config says and the
    row is a prompt's; 0 past the end: no decay, no input), x [BT, BP], B and C [BT, BN] of the head's group, the
    cumulative dt * A and its total over the chunk."""
    toks = (t0 + tl.arange(0, BT)).to(tl.int64)
    mt = toks < end
    dt = _softplus(tl.load(dt_ptr + toks * stride_dt + h, mask=mt, other=0.0).to(tl.float32) + bias)
    if CLAMP:
        dt = tl.where(clamp_row, tl.minimum(tl.maximum(dt, dt_min), dt_max), dt)
    dt = tl.where(mt, dt, 0.0)
    g = h // (H // G)
    x = tl.load(x_ptr + toks[:, None] * stride_x + h * P + offs_p[None, :], mask=mt[:, None] & mp[None, :],
                other=0.0).to(tl.float32)
    Bm = tl.load(x_ptr + toks[:, None] * stride_x + INNER + g * N + offs_n[None, :],
                 mask=mt[:, None] & mn[None, :], other=0.0).to(tl.float32)
    Cm = tl.load(x_ptr + toks[:, None] * stride_x + INNER + G * N + g * N + offs_n[None, :],
                 mask=mt[:, None] & mn[None, :], other=0.0).to(tl.float32)
    cum = tl.cumsum(dt * A, 0)
    last = tl.sum(tl.where(tl.arange(0, BT) == BT - 1, cum, 0.0), 0)
    return toks, mt, dt, x, Bm, Cm, cum, last


@triton.jit
def _segment_state_kernel(x_ptr, dt_ptr, A_log_ptr, dt_bias_ptr, seg_ptr, inner_ptr, local_ptr, decay_ptr,
                          stride_x, stride_dt, dt_min, dt_max,
                          H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, INNER: tl.constexpr,
                          BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, CLAMP: tl.constexpr,
                          PREC: tl.constexpr):
    """One inner segment, one head, BP channels: the state the segment reaches from zeros (float32, to
    ``local[seg, h]``) and its total log decay (to ``decay[seg, h]``)."""
    seg = tl.load(inner_ptr + tl.program_id(0))
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mp, mn = offs_p < P, offs_n < N
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    t0 = tl.load(seg_ptr + seg * 6 + 1)
    end = tl.load(seg_ptr + seg * 6 + 2)
    clamp_row = tl.load(seg_ptr + seg * 6 + 5) != 0
    state = tl.zeros([BP, BN], dtype=tl.float32)
    total = 0.0
    while t0 < end:
        toks, mt, dt, x, Bm, Cm, cum, last = _load_chunk(x_ptr, dt_ptr, t0, end, h, offs_p, offs_n, mp, mn, A, bias,
                                                         dt_min, dt_max, clamp_row, stride_x, stride_dt, H, N, G, P,
                                                         INNER, BT, CLAMP)
        to_end = tl.exp(last - cum) * dt
        state = state * tl.exp(last) + tl.dot(tl.trans(x * to_end[:, None]), Bm, input_precision=PREC)
        total += last
        t0 += BT
    base = (seg.to(tl.int64) * H + h) * P * N
    tl.store(local_ptr + base + offs_p[:, None] * N + offs_n[None, :], state, mask=mp[:, None] & mn[None, :])
    tl.store(decay_ptr + seg * H + h, total)  # every channel block stores the same value


@triton.jit
def _scan_kernel(x_ptr, dt_ptr, A_log_ptr, D_ptr, dt_bias_ptr, pool_ptr, slots_ptr, seg_ptr, local_ptr, decay_ptr,
                 y_ptr, stride_x, stride_dt, stride_pool, dt_min, dt_max,
                 H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, INNER: tl.constexpr,
                 BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, CLAMP: tl.constexpr, PREC: tl.constexpr):
    """One segment, one head, BP channels: the state at the segment's start (the slot's, the earlier segments
    folded in), the segment's outputs chunk by chunk, and at the row's end the slot's new state."""
    seg = tl.program_id(0)
    row, h, offs_p, offs_n, mp, mn, m2, valid, addr, state, A, Dh, bias = _load_head(
        tl.load(seg_ptr + seg * 6), pool_ptr, slots_ptr, A_log_ptr, D_ptr, dt_bias_ptr, stride_pool, P, N, BP, BN)
    t0 = tl.load(seg_ptr + seg * 6 + 1)
    end = tl.load(seg_ptr + seg * 6 + 2)
    first = tl.load(seg_ptr + seg * 6 + 3)
    is_last = tl.load(seg_ptr + seg * 6 + 4) != 0
    clamp_row = tl.load(seg_ptr + seg * 6 + 5) != 0
    head_off = h * P * N + offs_p[:, None] * N + offs_n[None, :]
    j = first
    while j < seg:  # the row's earlier segments, in order
        dec = tl.exp(tl.load(decay_ptr + j * H + h).to(tl.float32))
        loc = tl.load(local_ptr + (j.to(tl.int64) * H) * P * N + head_off, mask=m2, other=0.0)
        state = state * dec + loc.to(tl.float32)
        j += 1
    offs_t = tl.arange(0, BT)
    causal = offs_t[:, None] >= offs_t[None, :]
    while t0 < end:
        toks, mt, dt, x, Bm, Cm, cum, last = _load_chunk(x_ptr, dt_ptr, t0, end, h, offs_p, offs_n, mp, mn, A, bias,
                                                         dt_min, dt_max, clamp_row, stride_x, stride_dt, H, N, G, P,
                                                         INNER, BT, CLAMP)
        decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        scores = tl.dot(Cm, tl.trans(Bm), input_precision=PREC) * decay  # [BT, BT]
        y = tl.dot(scores, x * dt[:, None], input_precision=PREC)
        y += tl.dot(Cm, tl.trans(state), input_precision=PREC) * tl.exp(cum)[:, None]
        y += Dh * x
        tl.store(y_ptr + (toks[:, None] * H + h) * P + offs_p[None, :], y, mask=mt[:, None] & mp[None, :])
        to_end = tl.exp(last - cum) * dt
        state = state * tl.exp(last) + tl.dot(tl.trans(x * to_end[:, None]), Bm, input_precision=PREC)
        t0 += BT
    tl.store(addr, state.to(pool_ptr.dtype.element_ty), mask=m2 & valid & is_last)


def channel_block(head_dim: int) -> int:
    return max(16, min(next_pow2(head_dim), 64))  # tl.dot takes tiles of 16 and more


def mamba2_scan(xbc: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                pool: torch.Tensor, slots: torch.Tensor, plan: ScanPlan, num_heads: int, head_dim: int,
                n_groups: int, state_size: int, dt_limit: tuple[float, float], chunk: int = SCAN_CHUNK) -> torch.Tensor:
    """Prefill of a varlen batch: xbc [T, conv_dim] (the conv's output, packed by row), dt [T, H] raw, the rows'
    state ``slots`` [B] (-1: from zeros, nothing written) and ``plan`` (``ScanPlan.build`` from the rows' lengths
    with the same ``chunk``); each row starts from its slot's state and leaves its final state there. Returns y
    [T, H, P] in float32 (the D skip included)."""
    num_tokens = xbc.shape[0]
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=xbc.device)
    if slots.shape[0] == 0 or num_tokens == 0:
        return y
    assert xbc.stride(-1) == 1 and dt.stride(-1) == 1 and pool[0].is_contiguous()
    bp = channel_block(head_dim)
    lo, hi = dt_limit
    clamp = lo > 0.0 or hi != float("inf")
    hi = float(hi) if hi != float("inf") else 3.0e38
    meta = dict(H=num_heads, P=head_dim, N=state_size, G=n_groups, INNER=num_heads * head_dim, BT=chunk, BP=bp,
                BN=max(16, next_pow2(state_size)), CLAMP=clamp,
                PREC="ieee" if xbc.dtype == torch.float32 else "tf32", num_warps=4)
    blocks = triton.cdiv(head_dim, bp)
    if plan.num_inner:
        local = torch.empty(plan.num_segments, num_heads, head_dim, state_size, dtype=torch.float32,
                            device=xbc.device)
        decay = torch.empty(plan.num_segments, num_heads, dtype=torch.float32, device=xbc.device)
        _segment_state_kernel[(plan.num_inner, num_heads, blocks)](
            xbc, dt, A_log, dt_bias, plan.table, plan.inner, local, decay, xbc.stride(0), dt.stride(0), float(lo),
            hi, **meta)
    else:
        local = decay = y  # not read: every row is one segment
    _scan_kernel[(plan.num_segments, num_heads, blocks)](
        xbc, dt, A_log, D, dt_bias, pool, slots, plan.table, local, decay, y, xbc.stride(0), dt.stride(0),
        pool.stride(0), float(lo), hi, **meta)
    return y
