"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE with a sigmoid-gated shared expert.

Expert weights are fused at load time from the checkpoint's per-expert keys into ``w13[E, 2I, H]`` and
``w2[E, H, I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .weights import TensorReader, copy_into
from ..ops.moe import fused_moe, route_topk


def _load_gate_up(r: TensorReader, prefix: str, inter: int, hidden: int) -> torch.Tensor:
    return torch.cat([r.get(f"{prefix}.gate_proj.weight", (inter, hidden)),
                      r.get(f"{prefix}.up_proj.weight", (inter, hidden))], dim=0)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.hidden, self.inter = hidden, inter
        kw = dict(dtype=dtype, device=device)
        self.gate_up = nn.Parameter(torch.empty(2 * inter, hidden, **kw), requires_grad=False)
        self.down = nn.Parameter(torch.empty(hidden, inter, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.gate_up)
        return F.linear(F.silu(h[:, :self.inter]) * h[:, self.inter:], self.down)

    def load(self, r: TensorReader, prefix: str) -> None:
        copy_into(self.gate_up, _load_gate_up(r, prefix, self.inter, self.hidden))
        copy_into(self.down, r.get(f"{prefix}.down_proj.weight", (self.hidden, self.inter)))


class SparseMoE(nn.Module):
    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device=None):
        super().__init__()
        self.hidden, self.inter = mc.hidden_size, mc.moe_intermediate_size
        self.num_experts, self.top_k, self.norm_topk = mc.num_experts, mc.num_experts_per_tok, mc.norm_topk_prob
        kw = dict(dtype=dtype, device=device)
        self.router = nn.Parameter(torch.empty(self.num_experts, self.hidden, **kw), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.inter, self.hidden, **kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, self.hidden, self.inter, **kw), requires_grad=False)
        self.shared = (MLP(self.hidden, mc.shared_expert_intermediate_size, dtype, device)
                       if mc.shared_expert_intermediate_size > 0 else None)
        self.shared_gate = (nn.Parameter(torch.empty(1, self.hidden, **kw), requires_grad=False)
                            if self.shared is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(F.linear(x, self.router), self.top_k, self.norm_topk)
        out = fused_moe(x, self.w13, self.w2, weights, ids)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out

    def load(self, r: TensorReader, prefix: str) -> None:
        copy_into(self.router, r.get(f"{prefix}.gate.weight", (self.num_experts, self.hidden)))
        for e in range(self.num_experts):
            ep = f"{prefix}.experts.{e}"
            copy_into(self.w13[e], _load_gate_up(r, ep, self.inter, self.hidden))
            copy_into(self.w2[e], r.get(f"{ep}.down_proj.weight", (self.hidden, self.inter)))
        if self.shared is not None:
            self.shared.load(r, f"{prefix}.shared_expert")
            copy_into(self.shared_gate, r.get(f"{prefix}.shared_expert_gate.weight", (1, self.hidden)))
