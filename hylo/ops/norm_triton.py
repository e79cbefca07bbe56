"""Triton RMSNorm kernels: zero-centred RMSNorm, the same fused with the residual add, and the GDN gated norm.
One program per row; rows are at most a few thousand wide, so a row fits one block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pair_rows import SortedPairRows
from .triton_pdl import pdl_enter
from .triton_utils import next_pow2, pdl_launch


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, res_out_ptr, y_ptr, gate_ptr, ROWS, N: tl.constexpr, eps,
                     ADD: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr = 1,
                     GATE_ROWS: tl.constexpr = 1, gate_stride=0, J: tl.constexpr = 1, PDL: tl.constexpr = False,
                     pos_ptr=None, wts_ptr=None, GATHER: tl.constexpr = False, PLAIN: tl.constexpr = False):
    """BR rows per program (one at decode; more at prefill, where one narrow row per program leaves most of each
    program's threads idle). GATHER: the J delta rows of row r are rows pos[r * J + j] of r_ptr, weighted by
    wts[r * J + j] (``ops.pair_rows.SortedPairRows``)."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    mr = rows < ROWS
    offs = tl.arange(0, BN)
    m = mr[:, None] & (offs < N)[None, :]
    rows64 = rows.to(tl.int64)
    at = rows64[:, None] * N + offs[None, :]
    x = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    if ADD:
        # J delta rows per row (unreduced MoE pair outputs), summed in float32 with the residual
        if GATHER:  # the weighted sum first, then the residual: as SortedPairRows.reduce and an add would
            acc = tl.zeros([BR, BN], dtype=tl.float32)
            for j in tl.static_range(J):
                src = tl.load(pos_ptr + rows64 * J + j, mask=mr, other=0).to(tl.int64)
                wj = tl.load(wts_ptr + rows64 * J + j, mask=mr, other=0.0).to(tl.float32)
                acc += wj[:, None] * tl.load(r_ptr + src[:, None] * N + offs[None, :], mask=m,
                                             other=0.0).to(tl.float32)
            x += acc
        else:
            for j in tl.static_range(J):
                x += tl.load(r_ptr + (rows64[:, None] * J + j) * N + offs[None, :], mask=m,
                             other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + at, x, mask=m)
        x = x.to(tl.float32)  # normalise the rounded sum, as the reference does
    inv = tl.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None]
    w = tl.load(w_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        # reference order: normalise in float32, cast, scale by w in the input dtype, gate in float32
        y = (x * inv).to(y_ptr.dtype.element_ty).to(tl.float32) * w
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        # the gate is a strided view: row r is head r % GATE_ROWS of token r // GATE_ROWS
        g_off = (rows64 // GATE_ROWS) * gate_stride + (rows64 % GATE_ROWS) * N
        gate = tl.load(gate_ptr + g_off[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
        y = y * (gate / (1.0 + tl.exp(-gate)))
    elif PLAIN:  # a plain weight (the Mamba2 families' norms), applied in float32
        y = x * inv * w
    else:
        y = x * inv * (1.0 + w)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    n = x.shape[-1]
    return x.reshape(-1, n), n


def _run(rows: int, n: int, args: tuple, per_row: int = 1, **kw) -> None:
    """Launch the norm kernel: one row per program with few rows (decode and verify, up to batch 256:
    latency-bound, more programs in flight); at prefill, rows packed into tiles of about 4096 elements (8 warps)
    per program."""
    bn = next_pow2(n)
    if rows < 1024:
        br, warps = 1, 16 if per_row > 1 else 4 if n <= 2048 else 8
    else:
        br, warps = max(1, 4096 // bn), 8
    _rms_norm_kernel[(triton.cdiv(rows, br),)](*args, BR=br, BN=bn, num_warps=warps, **kw)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, plain: bool = False) -> torch.Tensor:
    """Zero-centred (``x / rms(x) * (1 + w)``), or with ``plain`` ``x / rms(x) * w``; in float32, rounded once."""
    x2, n = _rows(x.contiguous())
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _run(x2.shape[0], n, (x2, x2, weight, x2, y, x2, x2.shape[0], n, eps), ADD=False, GATED=False,
             PLAIN=plain, **pdl_launch(x2))
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta, weight: torch.Tensor, eps: float, plain: bool = False):
    """(x + delta, rms_norm(x + delta)) in one pass (``plain``: the plain weight); ``delta`` [..., J, N] (one more dimension than ``x``) adds
    the sum of its J rows; a :class:`ops.pair_rows.SortedPairRows` adds each row's weighted sum of its pairs' rows,
    gathered here."""
    x2, n = _rows(x.contiguous())
    res, y = torch.empty_like(x2), torch.empty_like(x2)
    if isinstance(delta, SortedPairRows):
        if delta.num_tokens != x2.shape[0] or delta.ys.shape[-1] != n:
            raise ValueError(f"add_rms_norm: pair rows of {delta.num_tokens} tokens x {delta.ys.shape[-1]} for "
                             f"a residual of {tuple(x.shape)}")
        per_row, d2 = delta.top_k, delta.ys
        gather = dict(pos_ptr=delta.pos, wts_ptr=delta.weights, GATHER=True)
    else:
        per_row = delta.shape[-2] if delta.dim() == x.dim() + 1 else 1
        d2, gather = _rows(delta.contiguous())[0], {}
    if x2.shape[0]:
        _run(x2.shape[0], n, (x2, d2, weight, res, y, x2, x2.shape[0], n, eps), per_row, ADD=True, GATED=False,
             J=per_row, PLAIN=plain, **gather, **pdl_launch(x2))
    return res.view(x.shape), y.view(x.shape)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: [..., rows_per_token, N]; the gate may be a view into a wider projection (read in place)."""
    x2, n = _rows(x.contiguous())
    if gate.dim() == 3 and gate.stride(-1) == 1 and gate.stride(-2) == n:
        g2, per_token, g_stride = gate, gate.shape[-2], gate.stride(0)
    else:
        g2, per_token, g_stride = gate.reshape(-1, n).contiguous(), 1, n
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _run(x2.shape[0], n, (x2, x2, weight, x2, y, g2, x2.shape[0], n, eps), ADD=False, GATED=True,
             GATE_ROWS=per_token, gate_stride=g_stride, **pdl_launch(x2))
    return y.view(x.shape)


@triton.jit
def _qk_norm_rope_kernel(proj_ptr, pos_ptr, qw_ptr, kw_ptr, inv_freq_ptr, q_ptr, k_ptr, stride_p, eps,
                         H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
                         K_OFF: tl.constexpr, vc_ptr=None, loc_ptr=None, STORE_KV: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """Per (token, head): zero-centred RMSNorm of the head (q_norm or k_norm), then rotary on its first R channels
    (rotate-half layout), reading q and k straight out of the fused projection. With STORE_KV, ``k_ptr`` is the
    layer's key cache [N, KVH, D]: a key head goes to the token's pool location (``loc_ptr``), and its program
    also copies the value head of the same index (after the keys in the projection) to the value cache
    ``vc_ptr``."""
    pdl_enter(PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    is_q = head < H
    col = tl.where(is_q, head * D, K_OFF + (head - H) * D)
    offs = tl.arange(0, BD)
    md = offs < D
    half: tl.constexpr = R // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    row = proj_ptr + tok * stride_p + col
    x = tl.load(row + offs, mask=md, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=md & (offs < R), other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.where(is_q, tl.load(qw_ptr + offs, mask=md, other=0.0), tl.load(kw_ptr + offs, mask=md, other=0.0))
    wp = tl.where(is_q, tl.load(qw_ptr + partner, mask=md & (offs < R), other=0.0),
                  tl.load(kw_ptr + partner, mask=md & (offs < R), other=0.0))
    # the normed values, rounded to the output dtype as the unfused path does before rotating
    y = (x * inv * (1.0 + w.to(tl.float32))).to(q_ptr.dtype.element_ty).to(tl.float32)
    yp = (xp * inv * (1.0 + wp.to(tl.float32))).to(q_ptr.dtype.element_ty).to(tl.float32)
    pos = tl.load(pos_ptr + tok).to(tl.float32)
    i = tl.where(offs < half, offs, offs - half)
    freq = pos * tl.load(inv_freq_ptr + i, mask=offs < R, other=0.0)
    c, s = tl.cos(freq), tl.sin(freq)
    rot = tl.where(offs < half, y * c - yp * s, y * c + yp * s)
    out = tl.where(offs < R, rot, y)
    if is_q:
        tl.store(q_ptr + (tok * H + head) * D + offs, out.to(q_ptr.dtype.element_ty), mask=md)
    elif STORE_KV:
        dst = tl.load(loc_ptr + tok).to(tl.int64) * (KVH * D) + (head - H) * D
        tl.store(k_ptr + dst + offs, out.to(k_ptr.dtype.element_ty), mask=md)
        val = tl.load(proj_ptr + tok * stride_p + K_OFF + KVH * D + (head - H) * D + offs, mask=md)
        tl.store(vc_ptr + dst + offs, val.to(vc_ptr.dtype.element_ty), mask=md)
    else:
        tl.store(k_ptr + (tok * KVH + head - H) * D + offs, out.to(k_ptr.dtype.element_ty), mask=md)


def qk_norm_rope(proj: torch.Tensor, positions: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                 heads: int, kv_heads: int, dim: int, rotary_dim: int, inv_freq: torch.Tensor, eps: float,
                 k_offset: int, kv_store: tuple | None = None):
    """proj: [T, W] fused projection with q at column 0, k at ``k_offset`` and v right after k; inv_freq:
    [rotary_dim / 2] float32. Returns q [T, H, D], k [T, KVH, D]; with ``kv_store`` = (key cache, value cache,
    locations [T]) (caches [N, KVH, D], contiguous, of proj's dtype) the keys and values go straight to the
    tokens' pool locations instead, and k comes back None."""
    tokens = proj.shape[0]
    q = torch.empty(tokens, heads, dim, dtype=proj.dtype, device=proj.device)
    if kv_store is not None:
        k, v_cache, loc = kv_store
        extra = dict(vc_ptr=v_cache, loc_ptr=loc, STORE_KV=True)
    else:
        k, extra = torch.empty(tokens, kv_heads, dim, dtype=proj.dtype, device=proj.device), {}
    if tokens:
        _qk_norm_rope_kernel[(tokens, heads + kv_heads)](
            proj, positions, q_norm, k_norm, inv_freq, q, k, proj.stride(0), eps, H=heads, KVH=kv_heads,
            D=dim, R=rotary_dim, BD=next_pow2(dim), K_OFF=k_offset, **extra, num_warps=2, **pdl_launch(proj))
    return q, None if kv_store is not None else k
