"""Block-quantized FP8 weights, as Qwen and DeepSeek ship them: float8_e4m3fn values with one float scale per
``[bn, bk]`` block of the weight's last two dimensions (partial blocks at the right and bottom edges), stored as
``<name>_scale_inv`` beside ``<name>``. The stored scale multiplies: ``w ~= q * scale_inv`` over its block.

These are the torch references; a checkpoint is dequantized through them at load.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of a weight's scale tensor: one entry per (possibly partial) block of its last two dims."""
    *lead, n, k = shape
    bn, bk = block
    return (*lead, -(-n // bn), -(-k // bk))


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over the block's elements, cut to ``shape`` at the edges."""
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :shape[-2], :shape[-1]]


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weights from FP8 values and their per-block scales (any leading dims: fused experts)."""
    expected = scale_grid(tuple(q.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {list(scale_inv.shape)} does not match weight shape {list(q.shape)} with "
                         f"blocks {list(block)} (expected {list(expected)})")
    return q.to(torch.float32) * _expand(scale_inv.to(torch.float32), tuple(q.shape), block)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, float32 per-block scales) of ``w``: each block scaled so that its largest magnitude maps to the
    format's largest finite value (an all-zero block gets scale 1)."""
    *lead, n, k = w.shape
    bn, bk = block
    grid = scale_grid(tuple(w.shape), block)
    wf = w.to(torch.float32)
    padded = torch.zeros(*lead, grid[-2] * bn, grid[-1] * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = wf
    blocks = padded.unflatten(-1, (grid[-1], bk)).unflatten(-3, (grid[-2], bn))  # [..., gn, bn, gk, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., gn, gk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / _expand(scale, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
