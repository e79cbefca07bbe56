"""Triton kernel for the causal depthwise conv1d + SiLU over S steps per row (S = 1 decode, S = k + 1 verify).

One program per (row, block of channels). The window of step s is ``[state[s:], x[:s + 1]]``: every element is
loaded from where it lives (the slot's conv state or the new inputs), so nothing needs shifting in registers.
Decode writes the new window back to the slot (-1: zero state, nothing written); verify writes the window after
every step to ``verify[row, step]`` and never the slot.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_pdl
from .triton_pdl import pdl_enter
from .triton_utils import env_cfg, next_pow2, pdl_launch

EARLY_LOADS = "conv" in triton_pdl.EARLY_LOADS  # HYLO_EARLY_LOADS (``triton_pdl``)


@triton.jit
def _conv_steps_kernel(
    x_ptr, w_ptr, pool_ptr, slots_ptr, out_ptr, verify_ptr,
    stride_x, stride_out, stride_pool, stride_vrow, stride_vstep, C,
    S: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, VERIFY: tl.constexpr, EARLY: tl.constexpr = False,
    KP: tl.constexpr = 4, PDL: tl.constexpr = False, bias_ptr=None, HAS_BIAS: tl.constexpr = False,
):
    """EARLY (one decode step, S = 1, no VERIFY): the window and the weights (KP >= K columns) are loaded before
    ``pdl_enter`` (the kernel before this one writes neither: ``triton_pdl.EARLY_LOADS``), then only the new input
    column after it. HAS_BIAS: a per-channel bias added before the SiLU (Mamba2's conv)."""
    if not EARLY:
        pdl_enter(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = offs < C
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    state_base = pool_ptr + safe_slot * stride_pool + offs * (K - 1)  # state[c, j] at state_base + j
    if EARLY:
        _conv_decode_early(x_ptr + row * stride_x, w_ptr, state_base, out_ptr + row * stride_out, offs, mc, valid,
                           K, KP, PDL, bias_ptr, HAS_BIAS)
        return
    bias = tl.load(bias_ptr + offs, mask=mc, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    for s in tl.static_range(S):
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(K):
            idx = j + s  # position in [state (K-1) | x (S)]
            if idx < K - 1:
                val = tl.load(state_base + idx, mask=mc & valid, other=0.0).to(tl.float32)
            else:
                val = tl.load(x_ptr + (row * S + idx - (K - 1)) * stride_x + offs, mask=mc, other=0.0).to(tl.float32)
            acc += val * tl.load(w_ptr + offs * K + j, mask=mc, other=0.0).to(tl.float32)
        acc += bias
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (row * S + s) * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mc)
        if VERIFY:
            for j in tl.static_range(K - 1):
                vidx = j + s + 1
                if vidx < K - 1:
                    wv = tl.load(state_base + vidx, mask=mc & valid, other=0.0).to(tl.float32)
                else:
                    wv = tl.load(x_ptr + (row * S + vidx - (K - 1)) * stride_x + offs, mask=mc,
                                 other=0.0).to(tl.float32)
                tl.store(verify_ptr + row * stride_vrow + s * stride_vstep + offs * (K - 1) + j,
                         wv.to(verify_ptr.dtype.element_ty), mask=mc)
    if not VERIFY:
        # the new window is the last K-1 of [state | x]. In increasing j, element j reads index j + S > j, which
        # no earlier iteration has overwritten, so the shift can be done in place.
        for j in tl.static_range(K - 1):
            sidx = j + S
            if sidx < K - 1:
                sv = tl.load(state_base + sidx, mask=mc & valid, other=0.0).to(tl.float32)
            else:
                sv = tl.load(x_ptr + (row * S + sidx - (K - 1)) * stride_x + offs, mask=mc, other=0.0).to(tl.float32)
            tl.store(state_base + j, sv.to(pool_ptr.dtype.element_ty), mask=mc & valid)


@triton.jit
def _conv_decode_early(x_row, w_ptr, state_base, out_row, offs, mc, valid, K: tl.constexpr, KP: tl.constexpr,
                       PDL: tl.constexpr, bias_ptr, HAS_BIAS: tl.constexpr):
    """One decode step of ``_conv_steps_kernel`` with the window [BC, K - 1] and the weights [BC, K] loaded as
    blocks before ``pdl_enter``; after it, the new input column: the output silu(window . w[:, :K-1] + x w[:, K-1])
    and the window shifted by one in place."""
    offs_j = tl.arange(0, KP)
    mw = mc[:, None] & (offs_j < K - 1)[None, :]
    win = tl.load(state_base[:, None] + offs_j[None, :], mask=mw & valid, other=0.0).to(tl.float32)
    # the window's last K - 2 columns, which become its first ones
    rest = tl.load(state_base[:, None] + offs_j[None, :] + 1, mask=mw & (offs_j < K - 2)[None, :] & valid,
                   other=0.0)
    w = tl.load(w_ptr + offs[:, None] * K + offs_j[None, :], mask=mc[:, None] & (offs_j < K)[None, :],
                other=0.0).to(tl.float32)
    w_new = tl.sum(tl.where((offs_j == K - 1)[None, :], w, 0.0), 1)
    bias = tl.load(bias_ptr + offs, mask=mc, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    pdl_enter(PDL)
    x = tl.load(x_row + offs, mask=mc, other=0.0)
    acc = tl.sum(win * w, 1) + x.to(tl.float32) * w_new + bias
    tl.store(out_row + offs, (acc / (1.0 + tl.exp(-acc))).to(out_row.dtype.element_ty), mask=mc)
    shifted = tl.where((offs_j == K - 2)[None, :], x[:, None].to(rest.dtype), rest)
    tl.store(state_base[:, None] + offs_j[None, :], shifted.to(state_base.dtype.element_ty), mask=mw & valid)


# (channels per program, warps); tools/tune_kernels.py --only steps sweeps them, HYLO_CONV_STEPS_CFG overrides them
CONV_STEPS_CFG = env_cfg("HYLO_CONV_STEPS_CFG", (256, 4))


def conv_steps(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, steps: int = 1,
               verify: torch.Tensor | None = None, cfg: tuple[int, int] | None = None,
               out: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B * steps, C] (may be a strided view); weight: [C, K]; pool: [slots, C, K-1] (one layer);
    verify: [max_B, steps, C, K-1] (one layer) or None; bias: [C] or None. Returns silu(conv + bias)
    [B * steps, C] in x's dtype, written into ``out`` when given (rows of unit stride)."""
    num_tokens, channels = x.shape
    k = weight.shape[-1]
    if out is None:
        out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1
    batch = num_tokens // steps
    if batch == 0:
        return out
    bc, warps = cfg or CONV_STEPS_CFG
    vbuf = verify if verify is not None else pool
    _conv_steps_kernel[(batch, triton.cdiv(channels, bc))](
        x, weight, pool, slots, out, vbuf,
        x.stride(0), out.stride(0), pool.stride(0),
        vbuf.stride(0) if verify is not None else 0, vbuf.stride(1) if verify is not None else 0, channels,
        S=steps, K=k, BC=bc, VERIFY=verify is not None, EARLY=EARLY_LOADS and steps == 1 and verify is None,
        KP=next_pow2(k), num_warps=warps, **pdl_launch(x),
        **({"bias_ptr": bias, "HAS_BIAS": True} if bias is not None else {}),
    )
    return out


@triton.jit
def _conv_prefill_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, qsl_ptr, tok_row_ptr, out_ptr, stride_x, T, P0, P1,
                         stride_pool, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                         BLOCK_PLANE: tl.constexpr, bias_ptr=None, HAS_BIAS: tl.constexpr = False):
    """One program per (block of BT tokens, block of BC channels) of a varlen batch: the window of token i of its
    row is [state[i:], x[row start .. i]] (positions before the row come from the row's conv state). A block may
    straddle rows: every token looks up its own row. The K shifted loads of a block overlap and come from cache.

    The output is three contiguous planes of T rows each, of channels [0, P0), [P0, P0 + P1) and [P0 + P1, C)
    (P0 = C, P1 = 0: one plain [T, C] matrix)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    mt = t < T
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = offs < C
    row = tl.load(tok_row_ptr + t, mask=mt, other=0)
    start = tl.load(qsl_ptr + row)
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0
    state_base = pool_ptr + tl.where(valid, slot, 0).to(tl.int64) * stride_pool
    i = t - start
    m2 = mt[:, None] & mc[None, :]
    # only a block holding one of a row's first K-1 tokens reads conv states: the others skip those strided,
    # per-element loads altogether (masked off, they still cost their address math and load instructions)
    need_state = tl.min(tl.where(mt, i, K), 0) < K - 1
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        p = i + j - (K - 1)  # local position of window element j; negative: from the conv state
        from_x = (p >= 0)[:, None]
        val = tl.load(x_ptr + (start + p).to(tl.int64)[:, None] * stride_x + offs[None, :], mask=m2 & from_x,
                      other=0.0).to(tl.float32)
        if need_state:
            sv = tl.load(state_base[:, None] + offs[None, :] * (K - 1) + ((K - 1) + p)[:, None],
                         mask=m2 & valid[:, None] & (p < 0)[:, None], other=0.0).to(tl.float32)
            val = tl.where(from_x, val, sv)
        w = tl.load(w_ptr + offs * K + j, mask=mc, other=0.0).to(tl.float32)
        acc += val * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mc, other=0.0).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    if BLOCK_PLANE:
        # the block lies in one plane whose start and width are multiples of 8: the row offsets say so, and the
        # stores are 16-byte vectors (per-element plane offsets made them scalar: 261 us per layer at 8192 tokens)
        c0 = tl.program_id(1) * BC
        ps = tl.where(c0 >= P0 + P1, P0 + P1, tl.where(c0 >= P0, P0, 0)).to(tl.int64)
        wd = tl.where(c0 >= P0 + P1, C - P0 - P1, tl.where(c0 >= P0, P1, P0)).to(tl.int64)
        base = tl.multiple_of(ps * T + t.to(tl.int64) * wd + c0 - ps, 8)
        dst = base[:, None] + tl.arange(0, BC)[None, :]
    else:
        plane_start = tl.where(offs >= P0 + P1, P0 + P1, tl.where(offs >= P0, P0, 0)).to(tl.int64)
        width = tl.where(offs >= P0 + P1, C - P0 - P1, tl.where(offs >= P0, P1, P0)).to(tl.int64)
        dst = plane_start[None, :] * T + t.to(tl.int64)[:, None] * width[None, :] + (offs - plane_start)[None, :]
    tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _conv_row_at(tok_row_ptr, qsl_ptr, slots_ptr, pool_ptr, t, stride_pool, offs, mc):
    """The row of token t: its first token, the token after its last, and its conv state's addresses and mask."""
    row = tl.load(tok_row_ptr + t)
    slot = tl.load(slots_ptr + row)
    sbase = pool_ptr + tl.where(slot >= 0, slot, 0).to(tl.int64) * stride_pool + offs * 3
    return tl.load(qsl_ptr + row), tl.load(qsl_ptr + row + 1), sbase, mc & (slot >= 0)


@triton.jit
def _conv_window_elem(x_ptr, sbase, t, p, stride_x, offs, mc, smask):
    """Input p of a row (p < 0: entry K-1+p = 3+p of the row's conv state) at token t, in float32."""
    xv = tl.load(x_ptr + t.to(tl.int64) * stride_x + offs, mask=mc & (p >= 0), other=0.0).to(tl.float32)
    sv = tl.load(sbase + 3 + p, mask=smask & (p < 0), other=0.0).to(tl.float32)
    return tl.where(p >= 0, xv, sv)


@triton.jit
def _conv_prefill_walk_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, qsl_ptr, tok_row_ptr, out_ptr, stride_x, T, P0, P1,
                              stride_pool, C, BT: tl.constexpr, BC: tl.constexpr, NORM_D: tl.constexpr = 0,
                              bias_ptr=None, HAS_BIAS: tl.constexpr = False):
    """Width 4 only. One program per (BT consecutive tokens, BC channels inside one output plane) walks its tokens
    in order with the previous three inputs in registers: every input is loaded once (the 2D kernel above loads
    each K times and computes K sets of addresses and masks per element). A token that starts a row takes its
    window from that row's conv state; the row boundaries come from the row offsets, one lookup per row.
    NORM_D > 0: the first two planes (GDN q and k) leave L2-normalised per head of NORM_D channels (BC a multiple),
    as fla's l2norm would normalise them next: from the output rounded to its dtype, in float32."""
    t0 = tl.program_id(0) * BT
    c0 = tl.program_id(1) * BC
    offs = c0 + tl.arange(0, BC)
    mc = offs < C
    w0 = tl.load(w_ptr + offs * 4, mask=mc, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + offs * 4 + 1, mask=mc, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + offs * 4 + 2, mask=mc, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + offs * 4 + 3, mask=mc, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + offs, mask=mc, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    # the block's plane (starts and widths are multiples of 8, checked by the caller): row t at ps * T + t * wd
    ps = tl.where(c0 >= P0 + P1, P0 + P1, tl.where(c0 >= P0, P0, 0)).to(tl.int64)
    wd = tl.where(c0 >= P0 + P1, C - P0 - P1, tl.where(c0 >= P0, P1, P0)).to(tl.int64)
    dst = out_ptr + tl.multiple_of(ps * T + c0 - ps, 8) + tl.arange(0, BC)
    # the three inputs before t0, from x or from the conv state of t0's row
    start, end, sbase, smask = _conv_row_at(tok_row_ptr, qsl_ptr, slots_ptr, pool_ptr, t0, stride_pool, offs, mc)
    i0 = t0 - start
    a = _conv_window_elem(x_ptr, sbase, t0 - 3, i0 - 3, stride_x, offs, mc, smask)
    b = _conv_window_elem(x_ptr, sbase, t0 - 2, i0 - 2, stride_x, offs, mc, smask)
    c = _conv_window_elem(x_ptr, sbase, t0 - 1, i0 - 1, stride_x, offs, mc, smask)
    for tt in range(0, BT):
        t = t0 + tt
        if t < T:
            xv = tl.load(x_ptr + t.to(tl.int64) * stride_x + offs, mask=mc, other=0.0).to(tl.float32)
            if t == end:  # t starts the next (non-empty) row: its window is that row's conv state
                _, end, sbase, smask = _conv_row_at(tok_row_ptr, qsl_ptr, slots_ptr, pool_ptr, t, stride_pool,
                                                    offs, mc)
                a = tl.load(sbase, mask=smask, other=0.0).to(tl.float32)
                b = tl.load(sbase + 1, mask=smask, other=0.0).to(tl.float32)
                c = tl.load(sbase + 2, mask=smask, other=0.0).to(tl.float32)
            acc = a * w0 + b * w1 + c * w2 + xv * w3 + bias
            y = acc / (1.0 + tl.exp(-acc))
            if NORM_D > 0:
                if c0 < P0 + P1:
                    yh = tl.reshape(y.to(out_ptr.dtype.element_ty).to(tl.float32), [BC // NORM_D, NORM_D])
                    yh = yh / tl.sqrt(tl.sum(yh * yh, 1) + 1e-6)[:, None]
                    y = tl.reshape(yh, [BC])
            tl.store(dst + t.to(tl.int64) * wd, y.to(out_ptr.dtype.element_ty), mask=mc)
            a, b, c = b, c, xv


# (tokens per program, channels per program, warps[, walk]) of the prefill conv; walk = 1 picks the walking kernel
# (width 4, blocks inside one plane), else the 2D kernel, which also runs where the walk cannot (with
# CONV_PREFILL_2D_CFG). tools/tune_kernels.py --only conv sweeps both, 8192 tokens x 8192 channels on the H200:
# the walk (16, 512, 4) takes 143.6 us against the 2D kernel's best 268.6 (4, 256, 4); the bytes take 62.7
# (run -1524, bench/results/tune-steps-conv-20261203-1524.json).
def _parse_conv_cfg(text: str) -> tuple[int, ...]:
    try:
        cfg = tuple(int(v) for v in text.split(","))
    except ValueError:
        cfg = ()
    if len(cfg) not in (3, 4) or min(cfg[:3]) < 1 or cfg[3:] not in ((), (0,), (1,)):
        raise ValueError(f"HYLO_CONV_PREFILL_CFG={text!r}: expected tokens,channels,warps (three positive integers) "
                         "and optionally walk (0 or 1)")
    return cfg


CONV_PREFILL_CFG = _parse_conv_cfg(os.environ.get("HYLO_CONV_PREFILL_CFG", "16,512,4,1"))
CONV_PREFILL_2D_CFG = (4, 256, 4)


@triton.jit
def _conv_prefill_state_kernel(x_ptr, pool_ptr, slots_ptr, qsl_ptr, stride_x, stride_pool, C,
                               K: tl.constexpr, BC: tl.constexpr):
    """The row's new conv state: its last K-1 inputs (older ones from the old state if the row is short). Runs
    after the output kernel, which reads the old state."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    slot = tl.load(slots_ptr + row)
    mc = (offs < C) & (slot >= 0)
    start = tl.load(qsl_ptr + row)
    length = tl.load(qsl_ptr + row + 1) - start
    state_base = pool_ptr + tl.where(slot >= 0, slot, 0) * stride_pool + offs * (K - 1)
    # in increasing m, new[m] reads old[length + m] with length >= 1: never an entry already rewritten
    for m in tl.static_range(K - 1):
        q = length - (K - 1) + m
        xv = tl.load(x_ptr + (start + q) * stride_x + offs, mask=mc & (q >= 0), other=0.0).to(tl.float32)
        sv = tl.load(state_base + length + m, mask=mc & (q < 0), other=0.0).to(tl.float32)
        tl.store(state_base + m, tl.where(q >= 0, xv, sv).to(pool_ptr.dtype.element_ty), mask=mc)


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                 query_start_loc: torch.Tensor, extend_lens: list[int], token_row: torch.Tensor | None = None,
                 planes: tuple[int, int] | None = None, cfg: tuple[int, ...] | None = None, l2norm_head: int = 0,
                 bias: torch.Tensor | None = None):
    """Varlen prefill: x [T, C] packed by row; each row continues from its slot's conv state (-1: zeros, nothing
    written) and leaves its last K-1 inputs there. ``token_row`` [T] (each token's row, on the device) is derived
    from ``extend_lens`` when not given. Returns silu(conv) [T, C] in x's dtype; with ``planes`` (P0, P1), the
    same as three contiguous tensors [T, P0], [T, P1], [T, C - P0 - P1] (the GDN q, k, v: fla's kernels take them
    contiguous, and would otherwise copy each). With ``l2norm_head`` (and planes) a fourth value says whether the
    first two planes came out L2-normalised per head of that many channels (done where the walking kernel runs).
    ``bias`` [C]: added before the SiLU (Mamba2's conv)."""
    num_tokens, channels = x.shape
    k = weight.shape[-1]
    p0, p1 = planes if planes is not None else (channels, 0)
    flat = torch.empty(num_tokens * channels, dtype=x.dtype, device=x.device)
    normed = False
    if num_tokens:
        batch = len(extend_lens)
        tok_row = token_row if token_row is not None else torch.repeat_interleave(
            torch.arange(batch), torch.tensor(extend_lens, dtype=torch.long)).to(x.device)
        bt, bc, warps, *walk = cfg or CONV_PREFILL_CFG

        def block_plane(bc: int) -> bool:  # every block of bc channels lies in one plane, stored 8 at a time
            return p0 % bc == 0 and p1 % bc == 0 and (channels - p0 - p1) % 8 == 0

        if walk == [1]:
            # narrower blocks where the planes are not multiples of the tile (smaller models), down to 64 channels
            while bc > 64 and not block_plane(bc):
                bc //= 2
            if not (k == 4 and block_plane(bc)):  # the walk cannot run here: the 2D kernel's tiles
                bt, bc, warps, walk = *CONV_PREFILL_2D_CFG, []
        grid = (triton.cdiv(num_tokens, bt), triton.cdiv(channels, bc))
        bias_args = {"bias_ptr": bias, "HAS_BIAS": True} if bias is not None else {}
        if walk == [1]:
            normed = l2norm_head > 0 and planes is not None and bc % l2norm_head == 0
            _conv_prefill_walk_kernel[grid](x, weight, pool, slots, query_start_loc, tok_row, flat, x.stride(0),
                                            num_tokens, p0, p1, pool.stride(0), channels, BT=bt, BC=bc,
                                            NORM_D=l2norm_head if normed else 0, num_warps=warps, **bias_args)
        else:
            _conv_prefill_kernel[grid](x, weight, pool, slots, query_start_loc, tok_row, flat, x.stride(0), num_tokens,
                                       p0, p1, pool.stride(0), channels, K=k, BT=bt, BC=bc,
                                       BLOCK_PLANE=block_plane(bc), num_warps=warps, **bias_args)
        _conv_prefill_state_kernel[(batch, triton.cdiv(channels, 256))](
            x, pool, slots, query_start_loc, x.stride(0), pool.stride(0), channels, K=k, BC=256, num_warps=4)
    if planes is None:
        return flat.view(num_tokens, channels)
    a, b = num_tokens * p0, num_tokens * (p0 + p1)
    out = (flat[:a].view(num_tokens, p0), flat[a:b].view(num_tokens, p1),
           flat[b:].view(num_tokens, channels - p0 - p1))
    return out + (normed,) if l2norm_head else out
