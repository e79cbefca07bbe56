"""Norm layers."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import rms_norm


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (``x * (1 + w)``), the one used everywhere in Qwen3-Next except inside GDN."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
