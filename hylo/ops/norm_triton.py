"""Triton RMSNorm kernels: zero-centred RMSNorm, the same fused with the residual add, and the GDN gated norm.
One program per row; rows are at most a few thousand wide, so a row fits one block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, res_out_ptr, y_ptr, gate_ptr, N: tl.constexpr, eps,
                     ADD: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BN)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    if ADD:
        x = (x + tl.load(r_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + offs, x, mask=m)
        x = x.to(tl.float32)  # normalise the rounded sum, as the reference does
    inv = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if GATED:
        # reference order: normalise in float32, cast, scale by w in the input dtype, gate in float32
        y = (x * inv).to(y_ptr.dtype.element_ty).to(tl.float32) * w
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        gate = tl.load(gate_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
        y = y * (gate / (1.0 + tl.exp(-gate)))
    else:
        y = x * inv * (1.0 + w)
    tl.store(y_ptr + row * N + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    n = x.shape[-1]
    return x.reshape(-1, n), n


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2, n = _rows(x.contiguous())
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, x2, y, x2, n, eps, ADD=False, GATED=False,
                                         BN=next_pow2(n), num_warps=4 if n <= 2048 else 8)
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)) in one pass."""
    x2, n = _rows(x.contiguous())
    d2, _ = _rows(delta.contiguous())
    res, y = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, res, y, x2, n, eps, ADD=True, GATED=False,
                                         BN=next_pow2(n), num_warps=4 if n <= 2048 else 8)
    return res.view(x.shape), y.view(x.shape)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2, n = _rows(x.contiguous())
    g2, _ = _rows(gate.contiguous())
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, x2, y, g2, n, eps, ADD=False, GATED=True,
                                         BN=next_pow2(n), num_warps=4)
    return y.view(x.shape)
