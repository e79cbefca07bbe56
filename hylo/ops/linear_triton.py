"""Triton GEMV for few-row linears (decode): ``y = x W^T (+ b)`` for x [M <= 16, K], W [N, K].

At batch 1 cuBLAS reads the narrow output projections (GDN ``out_proj``, attention ``o_proj``: 2048 outputs from
4096 inputs) at about 2.2x their bytes, through a split-K kernel plus a reduction launch. Here the K range is split
over SPLIT programs per block of outputs so that enough loads are in flight, and each split writes its own float32
row: the caller either sums them or leaves them to the residual add that follows (``norm_triton.add_rms_norm``
sums unreduced rows), so the split costs no extra launch. The (padded) rows multiply on the tensor cores. What
the output projections apply to their input first is done as x is loaded: the attention output gate
``x * sigmoid(gate)``, or the GDN gated RMSNorm of each head (one head per K block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import l2_prefetch, pdl_enter
from .triton_utils import next_pow2, pdl_launch, prefetch_args

GEMV_MAX_ROWS = 16


@triton.jit
def _conv_epilogue(y, cw_ptr, pool_ptr, slots_ptr, stride_pool, C, offs_m, offs_n, mm, KC: tl.constexpr):
    """The decode step's causal conv (kernel KC) of output columns [0, C), one token per row: y [BM, BN] are this
    program's outputs, already rounded to the output dtype as the unfused projection stores them. Column c of row
    m convolves its slot's window (``pool[slot, c, 0..KC-2]``, zeros for slot -1) with y, and gets silu of that;
    the window shifts by one in place (slot -1 rows write nothing). A column belongs to exactly one program, so
    no other program reads the window this one rewrites. Other columns pass through. The arithmetic is
    ``conv1d_triton._conv_steps_kernel``'s, in its order."""
    mc = offs_n < C
    slot = tl.load(slots_ptr + offs_m, mask=mm, other=-1)
    valid = slot >= 0
    base = pool_ptr + tl.where(valid, slot, 0).to(tl.int64)[:, None] * stride_pool + offs_n[None, :] * (KC - 1)
    smask = (mm & valid)[:, None] & mc[None, :]
    conv = tl.zeros(y.shape, dtype=tl.float32)
    for j in tl.static_range(KC - 1):
        sv = tl.load(base + j, mask=smask, other=0.0)
        conv += sv.to(tl.float32) * tl.load(cw_ptr + offs_n * KC + j, mask=mc, other=0.0).to(tl.float32)[None, :]
        if j > 0:  # entry j moves to j - 1 (entry j - 1 was read the iteration before)
            tl.store(base + j - 1, sv, mask=smask)
    conv += y * tl.load(cw_ptr + offs_n * KC + KC - 1, mask=mc, other=0.0).to(tl.float32)[None, :]
    tl.store(base + KC - 2, y.to(pool_ptr.dtype.element_ty), mask=smask)
    return tl.where(mc[None, :], conv / (1.0 + tl.exp(-conv)), y)


@triton.jit
def _gemv_kernel(x_ptr, g_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_x, stride_g, eps,
                 K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                 PF_LINES: tl.constexpr = 0, PF_STRIDE: tl.constexpr = 64, PDL: tl.constexpr = False,
                 cw_ptr=None, pool_ptr=None, slots_ptr=None, stride_pool=0, C=0, KC: tl.constexpr = 0):
    split = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    if PDL and PF_LINES > 0:  # this program's slice of W does not depend on the previous kernel: start fetching it now
        offs_l = tl.minimum(split * K_SPLIT + tl.arange(0, PF_LINES) * PF_STRIDE, K - 1)
        l2_prefetch(w_ptr + tl.minimum(offs_n, N - 1)[:, None] * K + offs_l[None, :])
    pdl_enter(PDL)
    mm, mn = offs_m < M, offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BK):
        offs_k = split * K_SPLIT + k0 + tl.arange(0, BK)
        mk = offs_k < K
        m2 = mm[:, None] & mk[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=m2, other=0.0)
        if GATE == 1:
            g = tl.load(g_ptr + offs_m[:, None] * stride_g + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            # rounded to x's dtype as the unfused ``x * torch.sigmoid(gate)`` is
            x = (x.to(tl.float32) * tl.sigmoid(g).to(x.dtype).to(tl.float32)).to(x.dtype)
        elif GATE == 2:
            # the GDN output norm of one head (BK channels): normalise in float32, round, scale by the weight,
            # round, gate by silu(z) in float32, in the order of ``ops.norm.gated_rms_norm``
            g = tl.load(g_ptr + offs_m[:, None] * stride_g + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            xf = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(xf * xf, 1) / BK + eps)
            nw = tl.load(nw_ptr + tl.arange(0, BK)).to(tl.float32)
            y = (xf * inv[:, None]).to(x.dtype).to(tl.float32) * nw[None, :]
            y = y.to(x.dtype).to(tl.float32) * (g * tl.sigmoid(g))
            x = y.to(x.dtype)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
    if HAS_BIAS:
        acc += tl.where(split == 0, tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32), 0.0)[None, :]
    if KC > 0:
        acc = _conv_epilogue(acc.to(y_ptr.dtype.element_ty).to(tl.float32), cw_ptr, pool_ptr, slots_ptr, stride_pool,
                             C, offs_m, offs_n, mm, KC)
    tl.store(y_ptr + (offs_m[:, None] * SPLIT + split) * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


# (BN, BK, warps, stages) measured on the H200 (tools/tune_kernels.py, bench/results/tune-decode*-20261202.json):
# the GDN input projection (12352 x 2048) 14.1 us against cuBLAS's 15.8 (floor 11.8); the output projections
# (2048 x 4096) with 8 splits 6.4 us against cuBLAS's 8.7 plus its reduction launch (floor 3.9)
GEMV_CFG = (32, 128, 4, 4)
SPLIT_GEMV_CFG = (64, 128, 4, 4)


def choose_split(n: int, k: int, bn: int, bk: int, target_programs: int = 256) -> int:
    """Splits of K so that about ``target_programs`` programs stream W, each over at least ``bk`` of K."""
    split = 1
    while triton.cdiv(n, bn) * split < target_programs and k // (2 * split) >= bk:
        split *= 2
    return split


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, gate: torch.Tensor | None = None,
         split: int = 1, cfg: tuple[int, int, int, int] | None = None, norm_weight: torch.Tensor | None = None,
         eps: float = 1e-6, conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x, gate: [M, K] (M <= 16, unit stride along K); w: [N, K] contiguous. Returns [M, N] in x's dtype when
    ``split`` is 1, else the float32 partial sums of each K split, [M, split, N] (bias in split 0).

    The input is x, or ``x * sigmoid(gate)``, or with ``norm_weight`` [D] (D a power of two dividing K) the GDN
    gated norm of every D-channel head of x, ``gated_rms_norm(x, gate, norm_weight, eps)``.

    ``conv`` = (weight [C, KC], pool [slots, C, KC-1], state_slots [M]): one decode step of the causal conv on the
    first C outputs (``_conv_epilogue``): they come back as silu(conv), and each row's window in the pool moves
    on by that row's output, as ``conv1d.causal_conv1d_update_ref`` does (split 1 only)."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk, warps, stages = cfg or (GEMV_CFG if split == 1 else SPLIT_GEMV_CFG)
    k_split = triton.cdiv(k, split)
    bk = norm_weight.shape[0] if norm_weight is not None else min(bk, next_pow2(k_split))
    k_split = triton.cdiv(k_split, bk) * bk
    if split == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(m, split, n, dtype=torch.float32, device=x.device)
    g = gate if gate is not None else x
    _gemv_kernel[(triton.cdiv(n, bn), split)](
        x, g, norm_weight if norm_weight is not None else w, w, bias if bias is not None else w, y, m, n, k,
        x.stride(0), g.stride(0), eps, K_SPLIT=k_split, SPLIT=split, BM=16, BN=bn, BK=bk,
        GATE=0 if gate is None else 2 if norm_weight is not None else 1, HAS_BIAS=bias is not None,
        **prefetch_args(k_split, w),
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages, **pdl_launch(x),
        **_conv_args(conv, y, split))
    return y


def _conv_args(conv, y: torch.Tensor, split: int) -> dict:
    if conv is None:
        return {}
    weight, pool, slots = conv
    channels, kc = weight.shape
    assert split == 1 and kc >= 2 and weight.is_contiguous() and pool.shape[1:] == (channels, kc - 1)
    assert pool.stride(2) == 1 and pool.stride(1) == kc - 1 and slots.shape == (y.shape[0],) and channels <= y.shape[1]
    return dict(cw_ptr=weight, pool_ptr=pool, slots_ptr=slots, stride_pool=pool.stride(0), C=channels, KC=kc)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, y_ptr, N, stride_g, BN: tl.constexpr):
    """Program (row, block of BN): y = x * sigmoid(gate), with sigmoid(gate) rounded to the output dtype first as
    ``x * torch.sigmoid(gate)`` does; the gate row is read in place from its projection (a strided view)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0)
    g = tl.load(g_ptr + row * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(x.dtype)
    tl.store(y_ptr + row * N + offs, (x.to(tl.float32) * s.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=m)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` for x [M, N] and a gate [M, N] whose rows may be strided (the attention output gate
    at prefill: one pass instead of torch's strided sigmoid and the multiply, 0.86 ms over the 6 attention layers of
    an 8192-token bench-6b prefill on the H200)."""
    x = x.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    y = torch.empty_like(x)
    rows, n = x.shape
    if rows:
        bn = min(1024, next_pow2(n))
        _sigmoid_gate_kernel[(rows, triton.cdiv(n, bn))](x, gate, y, n, gate.stride(0), BN=bn, num_warps=4)
    return y
