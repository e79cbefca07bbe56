"""One-pass Triton draw for sampled rows: the counter-based noise of ``ops.sampling.uniform_noise`` and the
exponential race ``argmax(p / -log u)`` fused, so the noise over the vocabulary is never materialised.

The torch form computes the noise as about thirty elementwise passes over a [B, V] int64 tensor: at batch 64 and a
151936-word vocabulary, 78 MB per pass. Here each program streams its row's probabilities once, hashing each
column's key in registers with the same int64 arithmetic (values kept below 2^32), so the noise is bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_M32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _mix32(x, m32, c1, c2):
    """The 32-bit finaliser of ``ops.sampling._mix32`` on int64 values below 2^32."""
    x = x ^ (x >> 16)
    x = (x * c1) & m32
    x = x ^ (x >> 15)
    x = (x * c2) & m32
    return x ^ (x >> 16)


@triton.jit
def _draw_kernel(probs_ptr, keys_ptr, out_ptr, V, stride_p, BV: tl.constexpr):
    """Program b: the index of the largest p / -log(u) over row b (the first one on ties), u the noise of (row b's
    key, column)."""
    row = tl.program_id(0)
    m32 = tl.full([BV], _M32, tl.int64)
    c1 = tl.full([BV], 0x7FEB352D, tl.int64)
    c2 = tl.full([BV], 0x846CA68B, tl.int64)
    key = tl.load(keys_ptr + row)
    best = tl.full([BV], -1.0, tl.float32)
    best_idx = tl.full([BV], 0, tl.int64)
    v0 = 0
    while v0 < V:  # a while loop: the interpreter cannot run a for loop with run-time bounds
        cols = v0 + tl.arange(0, BV)
        m = cols < V
        p = tl.load(probs_ptr + row.to(tl.int64) * stride_p + cols, mask=m, other=0.0).to(tl.float32)
        c = cols.to(tl.int64)
        x = _mix32((key ^ ((c * tl.full([BV], 0x27D4EB2F, tl.int64)) & m32)) & m32, m32, c1, c2)
        x = _mix32(x ^ tl.full([BV], 0x165667B1, tl.int64), m32, c1, c2) >> 8
        u = (x.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(m, p / -tl.log(u), -1.0)
        better = score > best  # strict: an earlier column keeps a tie
        best_idx = tl.where(better, c, best_idx)
        best = tl.where(better, score, best)
        v0 += BV
    top = tl.max(best, 0)
    # the first column among the lanes holding the row's maximum
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, V), 0))


def draw_triton(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (unit stride along V); keys [B] int64, each row's noise key (``sampling.noise_keys``).
    Returns [B] int64."""
    batch, vocab = probs.shape
    out = torch.empty(batch, dtype=torch.int64, device=probs.device)
    if batch:
        _draw_kernel[(batch,)](probs, keys.contiguous(), out, vocab, probs.stride(0), BV=2048, num_warps=8)
    return out
