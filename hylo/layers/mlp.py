"""Non-gated MLPs of the Mamba2 families: ``down(relu(up(x)) ** 2)`` (Nemotron-H's squared ReLU), and Nemotron 3's
MoE of such experts."""

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


class GroupedSigmoidMoE(nn.Module):
    """Nemotron 3's MoE block (``config.GroupedRouter``): the float32 router, group-limited top-k on the biased
    sigmoid scores, non-gated squared-ReLU experts (on the ``latent_size`` projection of the input where there is
    one, projected back after), and a squared-ReLU shared expert on the block's input, added.

    Plain PyTorch, for the CPU: the experts are run one at a time over the tokens routed to them, which reads the
    routing on the host; the GPU's graphs cannot, so the family refuses these blocks on CUDA until the expert
    kernels take non-gated experts (``models/nemotron_h.py``)."""

    def __init__(self, mc, dtype: torch.dtype, device=None):
        super().__init__()
        r = mc.router
        kw = dict(dtype=dtype, device=device)
        self.spec, self.top_k, self.normalize = r, mc.num_experts_per_tok, mc.norm_topk_prob
        hidden, experts, inter = mc.hidden_size, mc.num_experts, mc.moe_intermediate_size
        width = r.latent_size or hidden
        self.hidden, self.width, self.inter, self.num_experts = hidden, width, inter, experts
        f32 = dict(dtype=torch.float32, device=device)
        self.gate = nn.Parameter(torch.empty(experts, hidden, **f32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(experts, **f32), requires_grad=False)
        self.up = nn.Parameter(torch.empty(experts, inter, width, **kw), requires_grad=False)
        self.down = nn.Parameter(torch.empty(experts, width, inter, **kw), requires_grad=False)
        latent = r.latent_size is not None
        self.fc1 = nn.Parameter(torch.empty(width, hidden, **kw), requires_grad=False) if latent else None
        self.fc2 = nn.Parameter(torch.empty(hidden, width, **kw), requires_grad=False) if latent else None
        self.shared = SquaredReluMLP(hidden, mc.shared_expert_intermediate_size, dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], float32 weights [T, k]) for the tokens x [T, H]."""
        r, tokens = self.spec, x.shape[0]
        scores = F.linear(x.float(), self.gate).sigmoid()
        biased = scores + self.bias
        per_group = self.num_experts // r.n_group
        group_score = biased.view(tokens, r.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        groups = group_score.topk(r.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
        biased = biased.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        ids = biased.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * r.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        h = x if self.fc1 is None else F.linear(x, self.fc1)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)  # summed in float32, as the reference
        for expert in ids.unique().tolist():
            rows, slot = (ids == expert).nonzero(as_tuple=True)
            y = F.linear(torch.square(F.relu(F.linear(h[rows], self.up[expert]))), self.down[expert])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        out = out.to(x.dtype)
        if self.fc2 is not None:
            out = F.linear(out, self.fc2)
        return out + self.shared(x)

    def load(self, r: TensorReader, prefix: str) -> None:
        e, i, w, h = self.num_experts, self.inter, self.width, self.hidden
        copy_into(self.gate, r.get(f"{prefix}.gate.weight", (e, h)))
        copy_into(self.bias, r.get(f"{prefix}.gate.e_score_correction_bias", (e,)))
        copy_into(self.up, torch.stack([r.get(f"{prefix}.experts.{j}.up_proj.weight", (i, w)) for j in range(e)]))
        copy_into(self.down, torch.stack([r.get(f"{prefix}.experts.{j}.down_proj.weight", (w, i)) for j in range(e)]))
        if self.fc1 is not None:
            copy_into(self.fc1, r.get(f"{prefix}.fc1_latent_proj.weight", (w, h)))
            copy_into(self.fc2, r.get(f"{prefix}.fc2_latent_proj.weight", (h, w)))
        self.shared.load(r, f"{prefix}.shared_experts")
