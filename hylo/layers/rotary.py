"""Rotary position embedding on the first ``rotary_dim`` channels of each head (rotate-half layout)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, base: float, device=None):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T]; q: [T, H, D]; k: [T, KVH, D]. Rotates the first rotary_dim channels of each head."""
        cos, sin = self._angles(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One tensor [T, H, D] alone (the keys of a pass that computes no queries)."""
        return self._rotate(x, *self._angles(positions))

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rot/2]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.rotary_dim // 2
        x1 = x[..., :half].float()
        x2 = x[..., half:self.rotary_dim].float()
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([rot, x[..., self.rotary_dim:]], dim=-1)
