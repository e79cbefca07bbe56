"""Non-gated MLPs of the Mamba2 families: ``down(relu(up(x)) ** 2)`` (Nemotron-H's squared ReLU), and Nemotron 3's
MoE of such experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.linear import dense, out_proj
from ..ops.moe import fused_moe, grouped_sigmoid_route, router_logits_f32
from ..ops.triton_utils import env_flag
from .weights import TensorReader, copy_into


# Nemotron 3's shared expert folded in as routed-size experts (session 26). Measured on an H100 in session 27
# (ab-decode-nemotron-3-nano-20261206-183548): batch 1 2.95 ms against 3.35 apart, batch 8 7.99 against 7.81 (its
# pairs read the shared weights per token there), prefill 8192 136.7 against 137.7. HYLO_NEMOTRON_FOLD_SHARED=0
# keeps it apart.
FOLD_SHARED = env_flag("HYLO_NEMOTRON_FOLD_SHARED", True)


class SquaredReluMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.hidden, self.inter = hidden, inter
        self.up_proj = nn.Parameter(torch.empty(inter, hidden, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden, inter, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[T, hidden]; with ``reduce=False`` possibly split-K rows [T, S, hidden] (``ops.linear.out_proj``)."""
        return out_proj(torch.square(F.relu(dense(x, self.up_proj))), self.down_proj, reduce=reduce)

    def load(self, r: TensorReader, prefix: str) -> None:
        copy_into(self.up_proj, r.get(f"{prefix}.up_proj.weight", (self.inter, self.hidden)))
        copy_into(self.down_proj, r.get(f"{prefix}.down_proj.weight", (self.hidden, self.inter)))


class GroupedSigmoidMoE(nn.Module):
    """Nemotron 3's MoE block (``config.GroupedRouter``): the float32 router, group-limited top-k on the biased
    sigmoid scores, non-gated squared-ReLU experts (on the ``latent_size`` projection of the input where there is
    one, projected back after), and a squared-ReLU shared expert on the block's input, added.

    The routing is plain torch (no host read, so CUDA graphs capture it); the experts go through ``ops.moe.fused_moe``
    with ``gated=False``: the per-expert reference on the CPU, the pair and grouped Triton kernels on the GPU.

    Where the experts see the block's input (no latent projection) and the shared expert's width is a multiple of
    theirs (Nemotron 3 Nano: 3712 = 2 x 1856), the shared expert is folded in as that many more experts, each a
    slice of its intermediate channels (the squared ReLU acts channel by channel, and the down projection sums over
    channels, so the slices' outputs add up to the shared expert's), routed to by every token with weight 1. The
    block is then the router, one routing launch and the two expert launches, where the shared expert apart took
    six launches at batch 1 (two GEMVs, the ReLU, the square, a cast and the add)."""

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
        latent = r.latent_size is not None
        shared = mc.shared_expert_intermediate_size
        foldable = FOLD_SHARED and not latent and shared and shared % inter == 0
        self.folded = shared // inter if foldable else 0  # the shared expert as that many experts
        self.up = nn.Parameter(torch.empty(experts + self.folded, inter, width, **kw), requires_grad=False)
        self.down = nn.Parameter(torch.empty(experts + self.folded, width, inter, **kw), requires_grad=False)
        self.fc1 = nn.Parameter(torch.empty(width, hidden, **kw), requires_grad=False) if latent else None
        self.fc2 = nn.Parameter(torch.empty(hidden, width, **kw), requires_grad=False) if latent else None
        self.shared = None if self.folded else SquaredReluMLP(hidden, shared, dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k]) for the tokens x [T, H]; the router in float32, as the
        reference."""
        r = self.spec
        return grouped_sigmoid_route(router_logits_f32(x, self.gate), self.bias, r.n_group, r.topk_group,
                                     self.top_k, self.normalize, r.routed_scaling_factor, self.folded)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[T, hidden]; with ``reduce=False`` and nothing to add after the experts (no latent projection, the
        shared expert folded in) possibly their unreduced rows (``ops.moe.fused_moe``), which the residual add
        that follows sums."""
        weights, ids = self.route(x)
        h = x if self.fc1 is None else dense(x, self.fc1)
        # summed in float32, as transformers
        out = fused_moe(h, self.up, self.down, weights, ids, gated=False,
                        reduce=reduce or self.fc2 is not None or self.shared is not None)
        if self.fc2 is not None:
            out = dense(out, self.fc2)
        return out if self.shared is None else out + self.shared(x)

    def load(self, r: TensorReader, prefix: str) -> None:
        e, i, w, h = self.num_experts, self.inter, self.width, self.hidden
        copy_into(self.gate, r.get(f"{prefix}.gate.weight", (e, h)))
        copy_into(self.bias, r.get(f"{prefix}.gate.e_score_correction_bias", (e,)))
        for j in range(e):
            copy_into(self.up[j], r.get(f"{prefix}.experts.{j}.up_proj.weight", (i, w)))
            copy_into(self.down[j], r.get(f"{prefix}.experts.{j}.down_proj.weight", (w, i)))
        if self.fc1 is not None:
            copy_into(self.fc1, r.get(f"{prefix}.fc1_latent_proj.weight", (w, h)))
            copy_into(self.fc2, r.get(f"{prefix}.fc2_latent_proj.weight", (h, w)))
        if self.shared is not None:
            self.shared.load(r, f"{prefix}.shared_experts")
            return
        n = self.folded * i  # the shared expert, as experts e .. e + folded - 1: slices of its channels
        up = r.get(f"{prefix}.shared_experts.up_proj.weight", (n, h))
        down = r.get(f"{prefix}.shared_experts.down_proj.weight", (h, n))
        for j in range(self.folded):
            copy_into(self.up[e + j], up[j * i:(j + 1) * i])
            copy_into(self.down[e + j], down[:, j * i:(j + 1) * i])
