"""Gated DeltaNet layer (the linear attention of Qwen3-Next and Qwen3.5).

The input projections are one fused weight ``[q | k | v | z | b | a]``: one matmul per step, and plain slices
instead of per-group reshapes. Checkpoints lay them out in other ways (Qwen3-Next groups q, k, v, z per key head in
``in_proj_qkvz``; Qwen3.5 keeps four separate tensors); the family's model file re-lays them at load time
(``read_in_proj``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends.gdn import GDNParams, GDNShape
from ..config import ModelConfig
from ..core import ForwardBatch
from ..ops.linear import dense, dense_pair, norm_out_proj
from .weights import TensorReader, copy_into, fp8_block_of, load_proj, proj_weight


class GatedDeltaNet(nn.Module):
    def __init__(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.layer_id = layer_id
        self.shape = GDNShape(mc.linear_num_key_heads, mc.linear_key_head_dim, mc.linear_num_value_heads,
                              mc.linear_value_head_dim)
        self.eps = mc.rms_norm_eps
        self.hidden = mc.hidden_size
        self.key_dim, self.value_dim = mc.linear_key_dim, mc.linear_value_dim
        self.conv_dim, self.kernel = mc.conv_dim, mc.linear_conv_kernel_dim
        hv = mc.linear_num_value_heads
        kw = dict(dtype=dtype, device=device)
        self.dtype, fp8 = dtype, fp8_block_of(mc)
        if fp8 is None:  # [q | k | v | z | b | a] rows
            self.in_proj = nn.Parameter(torch.empty(self.conv_dim + self.value_dim + 2 * hv, self.hidden, **kw),
                                        requires_grad=False)
            self.in_proj_ba = None
        else:  # FP8 [q | k | v | z], and [b | a] apart: the releases keep those few rows unquantized
            self.in_proj = proj_weight((self.conv_dim + self.value_dim, self.hidden), dtype, fp8, device)
            self.in_proj_ba = nn.Parameter(torch.empty(2 * hv, self.hidden, **kw), requires_grad=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel, **kw), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(hv, **kw), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(hv, **kw), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(mc.linear_value_head_dim, **kw), requires_grad=False)
        self.out_proj = proj_weight((self.hidden, self.value_dim), dtype, fp8, device)

    def params(self) -> GDNParams:
        return GDNParams(self.conv_weight, self.A_log, self.dt_bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend, reduce: bool = True) -> torch.Tensor:
        """[T, hidden]; with ``reduce=False`` possibly unreduced rows [T, S, hidden] (see ``ops.linear``)."""
        num_tokens = x.shape[0]
        s = self.shape
        if self.in_proj_ba is None:
            proj = dense(x, self.in_proj)
            mixed_qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, s.num_v_heads, s.num_v_heads], dim=-1)
        else:
            proj, ba = dense_pair(x, self.in_proj, self.in_proj_ba)
            mixed_qkv, z = proj.split([self.conv_dim, self.value_dim], dim=-1)
            b, a = ba.split([s.num_v_heads, s.num_v_heads], dim=-1)
        core = backend.linear_attention(self.layer_id, mixed_qkv, a, b, self.params(), s, batch)  # [T, Hv, Dv]
        return norm_out_proj(core.to(x.dtype), z.reshape(num_tokens, s.num_v_heads, s.head_v_dim), self.norm_weight,
                             self.eps, self.out_proj, reduce=reduce)

    def load(self, r: TensorReader, prefix: str, read_in_proj) -> None:
        """``read_in_proj(r, prefix, shape, hidden)``: the family's reader of the fused input projection."""
        s = self.shape
        if self.in_proj_ba is None:
            copy_into(self.in_proj, read_in_proj(r, prefix, s, self.hidden))
        else:
            rows = self.conv_dim + self.value_dim
            load_proj(self, "in_proj", r, lambda rd: read_in_proj(rd, prefix, s, self.hidden)[:rows], self.dtype)
            copy_into(self.in_proj_ba, read_in_proj(r, prefix, s, self.hidden)[rows:])
        copy_into(self.conv_weight, r.get(f"{prefix}.conv1d.weight", (self.conv_dim, 1, self.kernel))[:, 0])
        copy_into(self.A_log, r.get(f"{prefix}.A_log", (s.num_v_heads,)))
        copy_into(self.dt_bias, r.get(f"{prefix}.dt_bias", (s.num_v_heads,)))
        copy_into(self.norm_weight, r.get(f"{prefix}.norm.weight", (s.head_v_dim,)))
        load_proj(self, "out_proj", r, lambda rd: rd.get(f"{prefix}.out_proj.weight", (self.hidden, self.value_dim)),
                  self.dtype)
