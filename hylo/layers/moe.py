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
from ..ops.linear import dense, swiglu_down
from ..ops.moe import fused_moe, route_hidden


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

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[T, H]; with ``reduce=False`` possibly the unreduced split-K rows [T, S, H] of the down projection
        (the few-row path, ``ops.linear.swiglu_down``), which the residual add that follows sums."""
        return swiglu_down(dense(x, self.gate_up), self.down, reduce=reduce)

    def load(self, r: TensorReader, prefix: str) -> None:
        copy_into(self.gate_up, _load_gate_up(r, prefix, self.inter, self.hidden))
        copy_into(self.down, r.get(f"{prefix}.down_proj.weight", (self.hidden, self.inter)))


class SparseMoE(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert.

    When the shared expert has the routed experts' size (Qwen3-Next's does), it is folded in as expert ``E``: its
    weights are the last rows of ``w13``/``w2``, its gate is the last row of ``router``, and every token routes to
    it as one more pair with weight sigmoid(gate). The whole block is then one router matmul, one routing kernel and
    the two expert kernels.
    """

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device=None):
        super().__init__()
        self.hidden, self.inter = mc.hidden_size, mc.moe_intermediate_size
        self.num_experts, self.top_k, self.norm_topk = mc.num_experts, mc.num_experts_per_tok, mc.norm_topk_prob
        shared_inter = mc.shared_expert_intermediate_size
        self.fold_shared = shared_inter == self.inter
        kw = dict(dtype=dtype, device=device)
        n = self.num_experts + int(self.fold_shared)
        self.router = nn.Parameter(torch.empty(n, self.hidden, **kw), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(n, 2 * self.inter, self.hidden, **kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, self.hidden, self.inter, **kw), requires_grad=False)
        self.shared = (MLP(self.hidden, shared_inter, dtype, device)
                       if shared_inter > 0 and not self.fold_shared else None)
        self.shared_gate = (nn.Parameter(torch.empty(1, self.hidden, **kw), requires_grad=False)
                            if self.shared is not None else None)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[T, H]; with ``reduce=False`` possibly the unreduced pair rows [T, k, H] (the fast path's), or a large
        chunk's rows in expert order (``ops.pair_rows.SortedPairRows``), which the residual add that follows sums
        (``ops.norm.add_rms_norm``): one pass over them fewer per layer."""
        weights, ids = route_hidden(x, self.router, self.num_experts, self.top_k, self.norm_topk, self.fold_shared)
        out = fused_moe(x, self.w13, self.w2, weights, ids, reduce=reduce or self.shared is not None)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out

    def load(self, r: TensorReader, prefix: str) -> None:
        """Experts stored one by one (``experts.E.{gate,up,down}_proj.weight``, as transformers writes them) or
        fused (``experts.gate_up_proj`` [E, 2I, H] with the gate rows first, ``experts.down_proj`` [E, H, I], as
        some releases ship them)."""
        E, H, I = self.num_experts, self.hidden, self.inter
        copy_into(self.router[:E], r.get(f"{prefix}.gate.weight", (E, H)))
        if r.has(f"{prefix}.experts.gate_up_proj"):
            copy_into(self.w13[:E], r.get(f"{prefix}.experts.gate_up_proj", (E, 2 * I, H)))
            copy_into(self.w2[:E], r.get(f"{prefix}.experts.down_proj", (E, H, I)))
        else:
            for e in range(E):
                ep = f"{prefix}.experts.{e}"
                copy_into(self.w13[e], _load_gate_up(r, ep, I, H))
                copy_into(self.w2[e], r.get(f"{ep}.down_proj.weight", (H, I)))
        sp = f"{prefix}.shared_expert"
        if self.fold_shared:
            copy_into(self.w13[E], _load_gate_up(r, sp, self.inter, H))
            copy_into(self.w2[E], r.get(f"{sp}.down_proj.weight", (H, self.inter)))
            copy_into(self.router[E:], r.get(f"{prefix}.shared_expert_gate.weight", (1, H)))
        elif self.shared is not None:
            self.shared.load(r, sp)
            copy_into(self.shared_gate, r.get(f"{prefix}.shared_expert_gate.weight", (1, H)))
