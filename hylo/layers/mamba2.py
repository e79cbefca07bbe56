"""Mamba2 mixer layer (Nemotron-H, Granite-4.0-H, Falcon-H1): the input projection into ``[z | x B C | dt]``, the
conv and the SSD recurrence in the backend (``backends/mamba2.py``), then ``rms_norm(y * silu(z))`` per group of
channels and the output projection. Family scalars come in as data (``config.Mamba2Spec``); the checkpoint names are
the ones every Mamba2 family uses (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``).

Rounding, as transformers does it: a prefill's scan output reaches the norm in float32; a decode or verify step's
output is rounded to the activations' dtype first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.mamba2 import Mamba2Params
from ..config import Mamba2Spec
from ..core import ForwardBatch
from ..ops.linear import dense, out_proj
from ..ops.mamba2 import gate_then_norm_ref, norm_then_gate_ref
from ..ops.triton_utils import use_triton
from .weights import TensorReader, copy_into


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden: int, cfg: Mamba2Spec, layer_id: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.layer_id, self.hidden, self.cfg, self.dtype = layer_id, hidden, cfg, dtype
        kw = dict(dtype=dtype, device=device)
        rows = cfg.inner + cfg.conv_dim + cfg.num_heads  # [z | x B C | dt]

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

        self.in_proj = param(rows, hidden)
        self.in_proj_bias = param(rows) if cfg.proj_bias else None
        self.conv_weight = param(cfg.conv_dim, cfg.conv_kernel)
        self.conv_bias = param(cfg.conv_dim) if cfg.conv_bias else None
        self.A_log, self.D, self.dt_bias = param(cfg.num_heads), param(cfg.num_heads), param(cfg.num_heads)
        self.norm_weight = param(cfg.inner) if cfg.norm != "gate" else None
        self.out_proj = param(hidden, cfg.inner)
        self.out_proj_bias = param(hidden) if (cfg.proj_bias if cfg.out_bias is None else cfg.out_bias) else None

    def params(self) -> Mamba2Params:
        c = self.cfg
        return Mamba2Params(self.conv_weight, self.conv_bias, self.A_log, self.D, self.dt_bias, c.dt_limit,
                            c.chunk_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend, reduce: bool = True) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; with ``reduce=False`` possibly the output projection's float32 split-K rows
        [T, S, hidden] (``ops.linear.out_proj``), for the residual add that follows to sum."""
        s = self.cfg
        z, xbc, dt = dense(x, self.in_proj, self.in_proj_bias).split([s.inner, s.conv_dim, s.num_heads], dim=-1)
        y = backend.linear_attention(self.layer_id, xbc, dt, self.params(), s, batch)  # [T, H, P] float32
        y = y.reshape(x.shape[0], s.inner)
        if not batch.mode.is_extend:
            y = y.to(x.dtype)
        norm, group = s.norm, s.inner // s.n_groups
        if norm != "gate" and use_triton(y):
            from ..ops.mamba2_triton import gated_group_norm

            y = gated_group_norm(y, z, self.norm_weight, s.n_groups, s.norm_eps, norm == "gate_then_norm", x.dtype)
        elif norm == "gate_then_norm":
            y = gate_then_norm_ref(y, z, self.norm_weight, group, s.norm_eps)
        elif norm == "norm_then_gate":
            y = norm_then_gate_ref(y, z, self.norm_weight, group, s.norm_eps)
        else:
            y = y * F.silu(z)
        return out_proj(y.to(x.dtype), self.out_proj, self.out_proj_bias, reduce=reduce)

    def load(self, r: TensorReader, prefix: str) -> None:
        s = self.cfg
        copy_into(self.in_proj, r.get(f"{prefix}.in_proj.weight", tuple(self.in_proj.shape)))
        if self.in_proj_bias is not None:
            copy_into(self.in_proj_bias, r.get(f"{prefix}.in_proj.bias", tuple(self.in_proj_bias.shape)))
        copy_into(self.conv_weight, r.get(f"{prefix}.conv1d.weight", (s.conv_dim, 1, s.conv_kernel))[:, 0])
        if self.conv_bias is not None:
            copy_into(self.conv_bias, r.get(f"{prefix}.conv1d.bias", (s.conv_dim,)))
        for name in ("A_log", "D", "dt_bias"):
            copy_into(getattr(self, name), r.get(f"{prefix}.{name}", (s.num_heads,)))
        if self.norm_weight is not None:
            copy_into(self.norm_weight, r.get(f"{prefix}.norm.weight", (s.inner,)))
        copy_into(self.out_proj, r.get(f"{prefix}.out_proj.weight", (self.hidden, s.inner)))
        if self.out_proj_bias is not None:
            copy_into(self.out_proj_bias, r.get(f"{prefix}.out_proj.bias", (self.hidden,)))
