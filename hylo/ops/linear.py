"""The model's projections. On CUDA with few rows (decode) they run a Triton GEMV (``linear_triton``); the output
projections of the mixers may then come back as unreduced float32 split-K rows [M, S, N] for the residual add to
sum. Everywhere else (CPU, prefill) they are ``F.linear``.

A weight may be block FP8 (``ops.fp8.Fp8Weight``): the GEMV and, for more rows, the W8A16 matmul
(``fp8_triton``) dequantize its tiles as they load them; the reference path dequantizes the whole weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import gated_rms_norm
from .triton_utils import env_flag, env_int, use_triton


def _few_rows(x: torch.Tensor, w) -> bool:
    if not use_triton(x):
        return False
    from .fp8_triton import fp8_tiles_ok
    from .linear_triton import GEMV_MAX_ROWS

    if not isinstance(w, torch.Tensor) and not fp8_tiles_ok(w):
        return False
    return x.shape[0] <= GEMV_MAX_ROWS and x.stride(-1) == 1


# From this many rows (a prefill chunk) an FP8 projection is dequantized whole, in one Triton pass, and multiplied
# by cuBLAS: the dequantization's bytes (1 read, 2 written, 2 read again per weight) are a few percent of such a
# GEMM's time at 8192 rows, where the W8A16 Triton matmul ran the Qwen3.5-35B-A3B prefill at 4.65x its compute
# floor against bfloat16's 2.29x (session 24, H100). From 128 rows since session 33: a verify's projections (k = 3
# at batch 64 is 256 rows) went faster that way too, on the same H100 in one call (bench-6b-fp8's MTP step at batch
# 64 15.74 -> 15.09 ms, Qwen3.5-35B-A3B's 30.15 -> 29.26; every other record even). HYLO_FP8_DEQUANT_ROWS=0 keeps
# the W8A16 matmul for every size.
FP8_DEQUANT_ROWS = env_int("HYLO_FP8_DEQUANT_ROWS", 128, minimum=0)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of a weight tensor or of a block-FP8 weight: the W8A16 matmul for fewer rows than
    ``FP8_DEQUANT_ROWS``, else the weight dequantized in one pass and cuBLAS; on the CPU the reference's whole
    weight dequantized."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if use_triton(x) and w.q.dim() == 2:
        from .fp8_triton import dequantize, fp8_matmul, fp8_matmul_ok

        if 0 < FP8_DEQUANT_ROWS <= x.shape[0]:
            return F.linear(x, dequantize(w, x.dtype), bias)
        if fp8_matmul_ok(w):
            return fp8_matmul(x, w, bias)
    return F.linear(x, w.dequantize(x.dtype), bias)


def dense(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias for a wide projection (the GDN input projection, the attention qkv projection)."""
    if _few_rows(x, w):
        from .linear_triton import gemv

        return gemv(x, w, bias=bias)
    return linear(x, w, bias)


# The GDN input projection of an FP8 checkpoint is an FP8 weight (q, k, v, z) and a plain one (b, a: the releases
# keep those rows unquantized). On the few-row path both run in one GEMV launch, as bfloat16's single fused weight
# does (apart, the b / a rows are a second GEMV of 8 programs on every GDN layer's critical path: 18 more launches
# in a bench-6b-fp8 batch-1 step). HYLO_FP8_TAIL_ROWS=0 launches them apart, for an A/B.
FP8_TAIL_ROWS = env_flag("HYLO_FP8_TAIL_ROWS", True)


def dense_pair(x: torch.Tensor, w, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W^T, x T^T) for a wide projection W (plain or FP8) and a plain ``tail`` T of the same inputs: on the
    few-row path one launch, its outputs [M, N] and [M, NT] views of one [M, N + NT] row; elsewhere two."""
    if FP8_TAIL_ROWS and _few_rows(x, w) and tail.is_contiguous():  # (a plain tail adds no condition of its own)
        from .linear_triton import gemv

        y = gemv(x, w, tail=tail)
        return y[:, :-tail.shape[0]], y[:, -tail.shape[0]:]
    return dense(x, w), dense(x, tail)


def narrow(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T for a projection with few outputs (the MoE router: 2 blocks of 64 outputs from 2048 inputs). On the
    few-row path K is split so that enough loads are in flight, and the float32 partial rows [M, S, N] come back
    unreduced for the consumer to sum (the routing kernel does); elsewhere the plain [M, N]."""
    if _few_rows(x, w):
        return _split_gemv(x, w, reduce=False)
    if not isinstance(w, torch.Tensor):
        return linear(x, w)
    if x.is_cuda and w.shape[0] % 8:
        # an output row of 65 is not 16-byte aligned, and cuBLAS then runs an sm75 "align1" kernel (45 us per
        # layer at an 8192-token prefill on the H200, for 2 GFLOP); a zero-padded copy of the small weight gets an
        # aligned kernel, and the caller reads the first columns through the row stride
        return F.linear(x, _row_aligned(w))[:, :w.shape[0]]
    return F.linear(x, w)


def _row_aligned(w: torch.Tensor) -> torch.Tensor:
    """``w`` with zero rows appended up to a multiple of 8, made once per weight (again only if ``w`` is modified
    in place), not on every call: the copy would be a launch and a weight's worth of traffic per layer per step."""
    cached = getattr(w, "_hylo_row_aligned", None)
    if cached is None or cached[0] != w._version:
        cached = (w._version, F.pad(w.detach(), (0, 0, 0, -w.shape[0] % 8)))
        w._hylo_row_aligned = cached
    return cached[1]


def _split_gemv(x: torch.Tensor, w: torch.Tensor, reduce: bool, bk: int | None = None, programs: int = 256,
                **kw) -> torch.Tensor:
    from .linear_triton import SPLIT_GEMV_CFG, choose_split, gemv

    split = choose_split(w.shape[0], w.shape[1], SPLIT_GEMV_CFG[0], bk or SPLIT_GEMV_CFG[1], programs)
    y = gemv(x, w, split=split, **kw)
    return y.sum(1).to(x.dtype) if split > 1 and reduce else y


def out_proj(x: torch.Tensor, w, bias: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
    """x W^T + bias: a mixer's output projection. With ``reduce=False`` the few-row path may return float32
    partial rows [M, S, N] whose sum is the result."""
    if _few_rows(x, w):
        # 4 splits of K (128 programs at 2048 x 4096): 6.2 us at batch 1 and 8 on the H200 against 7.1 with 8
        # (tune_kernels --only gates, session 13); the gated-norm GDN projection does best with 8 (7.9 against 8.8)
        return _split_gemv(x, w, reduce, bias=bias, programs=128)
    return linear(x, w, bias)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """The dense MLP's activation: ``silu(gate) * up`` of h [M, 2I] (gate | up) in float32, rounded once."""
    if use_triton(h) and h.shape[0]:
        from .linear_triton import silu_mul

        return silu_mul(h)
    return swiglu_ref(h)


def swiglu_ref(h: torch.Tensor) -> torch.Tensor:
    inter = h.shape[-1] // 2
    return (F.silu(h[..., :inter].float()) * h[..., inter:].float()).to(h.dtype)


def swiglu_down(h: torch.Tensor, w, reduce: bool = True) -> torch.Tensor:
    """``swiglu(h) W^T``: the dense MLP's down projection. On the few-row path the activation is computed as the
    GEMV loads h (no launch, no round trip of the activation) and, with ``reduce=False``, the float32 split-K
    partial rows [M, S, N] come back unreduced for the residual add to sum."""
    if _few_rows(h, w):
        return _split_gemv(h, w, reduce, swiglu=True)
    return linear(swiglu(h), w)


# Programs of the GDN output projection with its norm (they set the splits of K): 256 (8 splits at 2048 x 4096)
# for several rows (session 13: 7.9 against 8.8 us with 4); for one row 128 (4 splits, each of two 512-channel
# blocks of whole heads): a batch-1 graph of 1.486 against 1.504 ms with 256 on the H200 (one round of
# ab-decode-20261204-211702). HYLO_GDN_NORM_PROGRAMS fixes one count for every batch.
NORM_PROGRAMS = env_int("HYLO_GDN_NORM_PROGRAMS", 0, minimum=0)


def norm_out_proj(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, w,
                  reduce: bool = True) -> torch.Tensor:
    """The GDN output: ``gated_rms_norm`` of every head of x [M, Hv, Dv] with gate z [M, Hv, Dv], then W^T; on the
    few-row path the norm runs inside the projection's loads (no launch, no round trip of the normed rows)."""
    rows, heads, dv = x.shape
    if (_few_rows(x, w) and x.is_contiguous() and z.stride(-1) == 1 and z.stride(-2) == dv
            and dv & (dv - 1) == 0 and 16 <= dv <= 256 and (isinstance(w, torch.Tensor) or w.block[1] % dv == 0)):
        return _split_gemv(x.view(rows, heads * dv), w, reduce, bk=dv, gate=z.flatten(1), norm_weight=norm_weight,
                           eps=eps, programs=NORM_PROGRAMS or (128 if rows == 1 else 256))
    core = gated_rms_norm(x, z, norm_weight, eps)
    return out_proj(core.reshape(rows, heads * dv), w, reduce=reduce)
