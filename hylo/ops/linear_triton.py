"""Triton GEMV for few-row linears (decode): ``y = x W^T`` for x [M <= 16, K], W [N, K].

At batch 1 cuBLAS picks split-K kernels plus a reduction launch for the narrow projections (GDN ``out_proj``,
attention ``o_proj``), and a generic GEMV for the router; this kernel streams W once with one program per block of
output columns, the rows of x held in registers, and the (padded) rows multiplied on the tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import next_pow2

GEMV_MAX_ROWS = 16


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K: tl.constexpr, stride_x, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    offs_m = tl.arange(0, BM)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    mm, mn = offs_m < M, offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int] = (16, 256, 4, 4)) -> torch.Tensor:
    """x: [M, K] (M <= 16, unit stride along K); w: [N, K] contiguous. cfg: (BN, BK, warps, stages)."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk, warps, stages = cfg
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, x.stride(0), BM=16, BN=bn, BK=min(bk, next_pow2(k)),
                                        num_warps=warps, num_stages=stages)
    return y
