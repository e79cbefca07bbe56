"""Non-gated MLPs of the Mamba2 families: ``down(relu(up(x)) ** 2)`` (Nemotron-H's squared ReLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear import dense, out_proj
from .weights import TensorReader, copy_into


class SquaredReluMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.hidden, self.inter = hidden, inter
        self.up_proj = nn.Parameter(torch.empty(inter, hidden, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden, inter, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return out_proj(torch.square(F.relu(dense(x, self.up_proj))), self.down_proj)

    def load(self, r: TensorReader, prefix: str) -> None:
        copy_into(self.up_proj, r.get(f"{prefix}.up_proj.weight", (self.inter, self.hidden)))
        copy_into(self.down_proj, r.get(f"{prefix}.down_proj.weight", (self.hidden, self.inter)))
