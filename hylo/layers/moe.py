"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE with a sigmoid-gated shared expert.

Expert weights are fused at load time from the checkpoint's per-expert keys into ``w13[E, 2I, H]`` and
``w2[E, H, I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.fp8 import fp8_blocks_of
from .weights import (TensorReader, copy_into, fp8_block_of, keep_plain, load_fp8_part, load_proj,
                      proj_weight)
from ..ops.linear import dense, swiglu_down
from ..ops.moe import fused_moe, route_hidden


def _gate_up_rows(r: TensorReader, prefix: str, inter: int, hidden: int) -> list[torch.Tensor]:
    """An expert's gate rows, then its up rows: the parts of its ``gate_up`` weight, top to bottom."""
    return [r.get(f"{prefix}.gate_proj.weight", (inter, hidden)), r.get(f"{prefix}.up_proj.weight", (inter, hidden))]


def _load_gate_up(r: TensorReader, prefix: str, inter: int, hidden: int) -> torch.Tensor:
    return _whole(_gate_up_rows(r, prefix, inter, hidden))


def _whole(rows: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    return rows if isinstance(rows, torch.Tensor) else torch.cat(rows, dim=-2)


def _copy_rows(param: torch.Tensor, rows: torch.Tensor | list[torch.Tensor]) -> None:
    """Copy a weight given whole or as parts stacked along its rows (no temporary of the whole)."""
    if isinstance(rows, torch.Tensor):
        rows = [rows]
    start = 0
    for part in rows:
        copy_into(param.narrow(-2, start, part.shape[-2]), part)
        start += part.shape[-2]


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device=None,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.hidden, self.inter, self.dtype = hidden, inter, dtype
        self.gate_up = proj_weight((2 * inter, hidden), dtype, fp8_block, device)
        self.down = proj_weight((hidden, inter), dtype, fp8_block, device)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[T, H]; with ``reduce=False`` possibly the unreduced split-K rows [T, S, H] of the down projection
        (the few-row path, ``ops.linear.swiglu_down``), which the residual add that follows sums."""
        return swiglu_down(dense(x, self.gate_up), self.down, reduce=reduce)

    def load_fused(self, r: TensorReader, gate_up_name: str, down_name: str) -> None:
        """From a checkpoint that stores gate and up fused (gate rows first: Granite's ``input_linear``)."""
        load_proj(self, "gate_up", r, lambda rd: rd.get(gate_up_name, (2 * self.inter, self.hidden)), self.dtype)
        load_proj(self, "down", r, lambda rd: rd.get(down_name, (self.hidden, self.inter)), self.dtype)

    def load(self, r: TensorReader, prefix: str) -> None:
        load_proj(self, "gate_up", r, lambda rd: _load_gate_up(rd, prefix, self.inter, self.hidden), self.dtype)
        load_proj(self, "down", r, lambda rd: rd.get(f"{prefix}.down_proj.weight", (self.hidden, self.inter)),
                  self.dtype)


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
        self.dtype, fp8 = dtype, fp8_block_of(mc)
        n = self.num_experts + int(self.fold_shared)
        self.router = nn.Parameter(torch.empty(n, self.hidden, **kw), requires_grad=False)
        self.w13 = proj_weight((n, 2 * self.inter, self.hidden), dtype, fp8, device)
        self.w2 = proj_weight((n, self.hidden, self.inter), dtype, fp8, device)
        self.shared = (MLP(self.hidden, shared_inter, dtype, device, fp8)
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
        fused = r.has(f"{prefix}.experts.gate_up_proj")
        parts = []  # (target index, read(reader) -> w13 rows (whole or in parts), read(reader) -> w2 rows)
        if fused:
            parts.append((slice(0, E), lambda rd: rd.get(f"{prefix}.experts.gate_up_proj", (E, 2 * I, H)),
                          lambda rd: rd.get(f"{prefix}.experts.down_proj", (E, H, I))))
        else:
            for e in range(E):
                ep = f"{prefix}.experts.{e}"
                parts.append((e, lambda rd, ep=ep: _gate_up_rows(rd, ep, I, H),
                              lambda rd, ep=ep: rd.get(f"{ep}.down_proj.weight", (H, I))))
        sp = f"{prefix}.shared_expert"
        if self.fold_shared:
            parts.append((E, lambda rd: _gate_up_rows(rd, sp, I, H),
                          lambda rd: rd.get(f"{sp}.down_proj.weight", (H, I))))
            copy_into(self.router[E:], r.get(f"{prefix}.shared_expert_gate.weight", (1, H)))
        elif self.shared is not None:
            self.shared.load(r, sp)
            copy_into(self.shared_gate, r.get(f"{prefix}.shared_expert_gate.weight", (1, H)))
        maps = r.scale_maps() if not isinstance(self.w13, torch.Tensor) else None
        if maps is not None and not all(
                fp8_blocks_of(_whole(read(r)), _whole(read(maps)), self.w13.block) is not None
                for _, read13, read2 in parts[:1] + parts[-1:] for read in (read13, read2)):
            # stored unquantized, or gate and up rows that do not end on a block (an intermediate size that is
            # not a multiple of the block): the experts are kept in the compute dtype
            maps = None
        if maps is None:
            keep_plain(self, "w13", self.dtype)
            keep_plain(self, "w2", self.dtype)
        for index, read13, read2 in parts:
            for w, read, name in ((self.w13, read13, "gate_up"), (self.w2, read2, "down")):
                if maps is None:
                    _copy_rows(w[index], read(r))
                else:
                    load_fp8_part(w[index], _whole(read(r)), _whole(read(maps)), f"{prefix}.experts ({name}, {index})")
