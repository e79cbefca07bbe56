"""One-pass Triton draw for sampled rows: the counter-based noise of ``ops.sampling.uniform_noise`` and the
exponential race ``argmax(p / -log u)`` fused, so the noise over the vocabulary is never materialised.

The torch form computes the noise as about thirty elementwise passes over a [B, V] int64 tensor: at batch 64 and a
151936-word vocabulary, 78 MB per pass. Here each program streams its row's probabilities once, hashing its row key
and each column in registers with the same int64 arithmetic (values kept below 2^32), so the noise is
bit-identical. The few-column noise of acceptance tests is one launch too (``uniform_noise_triton``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_M32 = tl.constexpr(0xFFFFFFFF)
# the noise's top value, the largest float32 below 1 (``sampling.U_MAX``; like the hash constants below, the
# reference's value written again here, so that the reference module never imports this one back)
_U_MAX = tl.constexpr(1.0 - 2.0 ** -24)


@triton.jit
def _i64(value):
    """A one-element int64 constant (a literal at or above 2^31 would otherwise be typed uint32)."""
    return tl.full([1], value, tl.int64)


@triton.jit
def _mix32(x):
    """The 32-bit finaliser of ``ops.sampling._mix32`` on int64 values below 2^32."""
    x = x ^ (x >> 16)
    x = (x * _i64(0x7FEB352D)) & _i64(_M32)
    x = x ^ (x >> 15)
    x = (x * _i64(0x846CA68B)) & _i64(_M32)
    return x ^ (x >> 16)


@triton.jit
def _row_key(seeds_ptr, steps_ptr, row, stream):
    """``ops.sampling.noise_keys`` of row ``row``: a one-element int64 tensor."""
    m32 = _i64(_M32)
    seed = tl.load(seeds_ptr + row + tl.arange(0, 1)).to(tl.int64)
    step = tl.load(steps_ptr + row + tl.arange(0, 1)).to(tl.int64)
    key = _mix32((seed & m32) ^ ((seed >> 32) * _i64(0x9E3779B1) & m32))
    return _mix32(key ^ ((step * _i64(0x85EBCA77) + _i64(stream) * _i64(0xC2B2AE3D)) & m32))


@triton.jit
def _column_noise(key, cols):
    """The uniform (0, 1) noise of (key, column), float32."""
    m32 = _i64(_M32)
    x = _mix32((key ^ ((cols.to(tl.int64) * _i64(0x27D4EB2F)) & m32)) & m32)
    x = _mix32(x ^ _i64(0x165667B1)) >> 8
    # clamped below 1 as ``sampling.uniform_noise_ref`` is (the top value's sum rounds up to 2^24)
    return tl.minimum((x.to(tl.float32) + 0.5) * (1.0 / 16777216.0), _U_MAX)


@triton.jit
def _noise_kernel(seeds_ptr, steps_ptr, out_ptr, stream, W, BW: tl.constexpr):
    """Program b: row b of ``ops.sampling.uniform_noise`` (W columns), bit for bit."""
    row = tl.program_id(0)
    key = _row_key(seeds_ptr, steps_ptr, row, stream)
    cols = tl.arange(0, BW)
    tl.store(out_ptr + row * W + cols, _column_noise(key, cols), mask=cols < W)


def uniform_noise_triton(seeds: torch.Tensor, steps: torch.Tensor, width: int, stream: int = 0) -> torch.Tensor:
    """``ops.sampling.uniform_noise`` for a few columns per row (acceptance tests, simulated acceptance) in one
    launch instead of about thirty: [B, width] float32."""
    batch = seeds.shape[0]
    out = torch.empty(batch, width, dtype=torch.float32, device=seeds.device)
    if batch and width:
        _noise_kernel[(batch,)](seeds.contiguous(), steps.contiguous(), out, stream, width,
                                BW=max(16, triton.next_power_of_2(width)), num_warps=1)
    return out


@triton.jit
def _draw_kernel(probs_ptr, seeds_ptr, steps_ptr, out_ptr, stream, V, stride_p, BV: tl.constexpr):
    """Program b: the index of the largest p / -log(u) over row b (the first one on ties), u the noise of (row b's
    key, column)."""
    row = tl.program_id(0)
    key = _row_key(seeds_ptr, steps_ptr, row, stream)
    best = tl.full([BV], -1.0, tl.float32)
    best_idx = tl.full([BV], 0, tl.int64)
    v0 = 0
    while v0 < V:  # a while loop: the interpreter cannot run a for loop with run-time bounds
        cols = v0 + tl.arange(0, BV)
        m = cols < V
        p = tl.load(probs_ptr + row.to(tl.int64) * stride_p + cols, mask=m, other=0.0).to(tl.float32)
        score = tl.where(m, p / -tl.log(_column_noise(key, cols)), -1.0)
        better = score > best  # strict: an earlier column keeps a tie
        best_idx = tl.where(better, cols.to(tl.int64), best_idx)
        best = tl.where(better, score, best)
        v0 += BV
    top = tl.max(best, 0)
    # the first column among the lanes holding the row's maximum
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, V), 0))


def draw_triton(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """``ops.sampling.draw`` in one launch: probs [B, V] (unit stride along V); seeds, steps [B] int64. [B] int64."""
    batch, vocab = probs.shape
    out = torch.empty(batch, dtype=torch.int64, device=probs.device)
    if batch:
        _draw_kernel[(batch,)](probs, seeds.contiguous(), steps.contiguous(), out, stream, vocab, probs.stride(0),
                               BV=2048, num_warps=8)
    return out
