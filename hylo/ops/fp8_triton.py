"""Triton W8A16 matmul: ``y = x W^T (+ b)`` with W block-FP8 (``ops.fp8.Fp8Weight``) and x in bfloat16 / float16 /
float32, for more rows than the GEMV takes (prefill chunks, decode batches past 16). Each [BK, BN] tile of W is
loaded as FP8 (half the bytes of bfloat16), converted to x's dtype (exactly: e4m3 values fit bfloat16) and multiplied
on the tensor cores; the tile's partial products are then scaled in float32. The tile's K range lies inside one
block of scales (BK divides the block's columns), so a tile needs one scale per output column. (Scaling every loaded
element instead, a float32 tile per K step, made the MoE kernels built that way about ten times slower than their
bfloat16 twins on an H100: ``bench/results/qwen3.5-35b-a3b-fp8-20261206-073525.json``, docs/PERFORMANCE.md.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import kernel_tileable
from .triton_utils import env_cfg, env_flag, env_int, next_pow2


@triton.jit
def block_scale(s_ptr, rows, row_mask, k0, SK: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr):
    """The float32 scales of weight rows ``rows`` (any shape) for the K tile starting at ``k0``, which lies inside
    one column block (the launcher keeps BK <= SBK, both powers of two): one scale per row, so a kernel multiplies
    a tile's partial dot products by it instead of every loaded element (``s_ptr``: SK scales a row of blocks).
    The expert kernels of ``moe_triton`` use it."""
    return tl.load(s_ptr + (rows // SBN) * SK + k0 // SBK, mask=row_mask, other=0.0)


# The one-row kernels' FP8 tiles may span several column blocks (``scaled_row_dot``, session 26; on an H100 in
# session 27 the 35B shape's batch-1 step went from 2.47x to 2.06x its byte floor). HYLO_FP8_WIDE_TILES=0 keeps them
# inside one block, as before, for an A/B. They take twice the bfloat16 tile's columns (HYLO_FP8_ROW_WIDEN, default
# 2: the same bytes in flight as bfloat16's): bench-6b-fp8 at batch 8 3.487 against 3.618 ms with bfloat16's
# columns (1), batch 1 even (1.477 / 1.476; session 28, H100, ab-decode-bench-6b-fp8-widen-20261206-211301.json).
FP8_WIDE_TILES = env_flag("HYLO_FP8_WIDE_TILES", True)
FP8_ROW_WIDEN = env_int("HYLO_FP8_ROW_WIDEN", 2)
if FP8_ROW_WIDEN & (FP8_ROW_WIDEN - 1):  # a tile's columns stay a power of two
    raise ValueError(f"HYLO_FP8_ROW_WIDEN={FP8_ROW_WIDEN}: expected a power of two (1, 2, 4, ...)")


def row_tile(bk: int, w, k: int) -> int:
    """A one-row kernel's K tile for weight ``w`` over a K extent of ``k``: ``bk`` for a bfloat16 weight; for an FP8
    one inside one column block without ``FP8_WIDE_TILES``, else ``bk`` widened by ``FP8_ROW_WIDEN`` up to k."""
    if isinstance(w, torch.Tensor):
        return bk
    if not FP8_WIDE_TILES:
        return min(bk, w.block[1])
    return max(bk, min(bk * FP8_ROW_WIDEN, next_pow2(k)))


@triton.jit
def scaled_row_dot(prod, s_ptr, rows, row_mask, k0, SK: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr):
    """The dot products of a one-row kernel's K tile: ``prod`` [BN, BK] holds the float32 products of weight rows
    ``rows`` (FP8 values) and the input, columns ``k0 .. k0 + BK``; each column block's partial sums times that
    block's scale, summed: [BN]. BK may span several column blocks (both powers of two): a one-row kernel streams
    wide tiles, since the bytes in flight per program are what reach the bandwidth at batch 1, and an FP8 tile
    kept inside one 128-column block holds a quarter of a bfloat16 tile's bytes (session 24's batch-1 FP8 decode
    ran at 2.5x its byte floor)."""
    # (one return, after a constexpr if / else: the compiler generates the code after an early return too, and a
    # tile narrower than a block would reshape to zero blocks there; the interpreter does not catch that)
    if BK <= SBK:
        out = tl.sum(prod, 1) * block_scale(s_ptr, rows, row_mask, k0, SK, SBN, SBK)
    else:
        NB: tl.constexpr = BK // SBK
        part = tl.sum(tl.reshape(prod, (BN, NB, SBK)), 2)
        kb = k0 // SBK + tl.arange(0, NB)
        scale = tl.load(s_ptr + (rows // SBN)[:, None] * SK + kb[None, :],
                        mask=row_mask[:, None] & (kb < SK)[None, :], other=0.0)
        out = tl.sum(part * scale, 1)
    return out


@triton.jit
def _fp8_matmul_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_x, SK: tl.constexpr,
                       SBN: tl.constexpr, SBK: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """Program (block of BM rows, block of BN outputs)."""
    offs_m = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mm, mn = offs_m < M, offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        w = tl.load(q_ptr + offs_n[None, :] * K + offs_k[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        # FP8 values are exact in x's dtype: the dot on them, then the tile's one scale per output column
        acc += tl.dot(x, w.to(x.dtype), input_precision=PREC) * block_scale(s_ptr, offs_n, mn, k0, SK, SBN,
                                                                            SBK)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


# (BM, BN, BK, warps, stages): ``tools/tune_fp8.py``'s pick for 64 to 256 rows (a verify step's; more rows are
# dequantized for cuBLAS, ``ops/linear.FP8_DEQUANT_ROWS``), session 32 on an H100. HYLO_FP8_MATMUL_CFG replaces it.
FP8_MATMUL_CFG = env_cfg("HYLO_FP8_MATMUL_CFG", (64, 64, 128, 4, 3))


def fp8_tiles_ok(w) -> bool:
    """Whether the W8A16 kernels (this matmul, the GEMV, the MoE kernels) take this weight (``fp8.kernel_tileable``)."""
    return kernel_tileable(w.block)


def fp8_matmul_ok(w) -> bool:
    """Whether :func:`fp8_matmul` takes this weight (2-D, ``fp8_tiles_ok``)."""
    return w.q.dim() == 2 and fp8_tiles_ok(w)


def fp8_matmul(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (unit stride along K) times the FP8 weight ``w`` [N, K] (``fp8_matmul_ok``), plus ``bias``: [M, N]
    in x's dtype."""
    m, k = x.shape
    n = w.q.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    bm, bn, bk, warps, stages = FP8_MATMUL_CFG
    bm = max(16, min(bm, next_pow2(m)))
    bk = min(bk, w.block[1], max(16, next_pow2(k)))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _fp8_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, w.q, w.scale, bias if bias is not None else x, y, m, n, k, x.stride(0), SK=w.scale.shape[-1],
            SBN=w.block[0], SBK=w.block[1], HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk,
            PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return y


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, y_ptr, N, K, SK: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
    """Program (block of BN rows, block of BK columns): y = q * its block's scale, rounded to y's dtype."""
    offs_n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    q = tl.load(q_ptr + offs_n[:, None] * K + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (offs_n // SBN)[:, None] * SK + (offs_k // SBK)[None, :], mask=m, other=0.0)
    tl.store(y_ptr + offs_n[:, None] * K + offs_k[None, :], (q * s).to(y_ptr.dtype.element_ty), mask=m)


def dequantize(w, dtype: torch.dtype) -> torch.Tensor:
    """A 2-D FP8 weight in ``dtype``, [N, K]: ``Fp8Weight.dequantize`` in one pass (each value times its block's
    scale in float32, rounded once)."""
    n, k = w.q.shape
    y = torch.empty(n, k, dtype=dtype, device=w.q.device)
    bn, bk = 32, 256
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](w.q, w.scale, y, n, k, SK=w.scale.shape[-1],
                                                               SBN=w.block[0], SBK=w.block[1], BN=bn, BK=bk,
                                                               num_warps=4)
    return y


def weight_values(w) -> torch.Tensor:
    """The stored values of a weight: the tensor, or an FP8 weight's float8 values (its scales go separately)."""
    return w if isinstance(w, torch.Tensor) else w.q


def fp8_kernel_args(w, prefix: str = "") -> dict:
    """The launch arguments that give a kernel an FP8 weight's scales (none for a plain tensor): per leading-dim
    entry (expert) S_E scales, SK a row of blocks, blocks [SBN, SBK]."""
    if isinstance(w, torch.Tensor):
        return {}
    p = prefix
    return {f"{p}s_ptr": w.scale, f"{p}S_E": w.scale[0].numel() if w.scale.dim() == 3 else 0,
            f"{p}SK": w.scale.shape[-1], f"{p}SBN": w.block[0], f"{p}SBK": w.block[1], f"{p}FP8": True}
