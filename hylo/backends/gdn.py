"""Gated DeltaNet backend: causal conv and the gated delta rule over the state pool, per forward mode.

- EXTEND: conv over the new tokens from the slot's conv window, chunked delta rule from the slot's recurrent state,
  both final states written back to the slot (a chunk continues exactly where the previous one stopped).
- DECODE: one conv update and one recurrent step, reading and writing the slot in place.
- TARGET_VERIFY: k + 1 steps from the slot, the state after every step written to the verify buffers at
  ``[row, step]``; the slot itself is never written (a rejected draft needs no rollback).
State slot -1 marks a padded row everywhere: it reads zeros and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.state_pool import StatePool
from ..core import ForwardBatch, ForwardMode
from ..ops import conv1d as conv_ops
from ..ops import gdn as gdn_ops
from .base import Backend


@dataclass(frozen=True)
class GDNShape:
    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    def split(self, mixed: torch.Tensor):
        """[..., conv_dim] -> q, k [..., Hk, Dk] and v [..., Hv, Dv]."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        lead = mixed.shape[:-1]
        return (q.reshape(*lead, self.num_k_heads, self.head_k_dim),
                k.reshape(*lead, self.num_k_heads, self.head_k_dim),
                v.reshape(*lead, self.num_v_heads, self.head_v_dim))


@dataclass
class GDNParams:
    """One GDN layer's parameters that the backend needs (views of the layer's own tensors)."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]


class GDNBackend(Backend):
    needs_cpu_seq_lens = False

    def __init__(self, state_pool: StatePool):
        self.state_pool = state_pool

    def forward(self, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params: GDNParams,
                shape: GDNShape, batch: ForwardBatch) -> torch.Tensor:
        """mixed_qkv: [T, conv_dim]; a, b: [T, Hv]. ``layer`` indexes the linear layers only.
        Returns the core output [T, Hv, Dv] in float32."""
        conv_pool = self.state_pool.conv[layer]
        rec_pool = self.state_pool.recurrent[layer]
        g, beta = gdn_ops.gdn_gating(params.A_log, a, params.dt_bias, b)
        if batch.mode.is_extend:
            return self._extend(conv_pool, rec_pool, mixed_qkv, g, beta, params, shape, batch)
        if batch.mode.is_decode:
            x = conv_ops.causal_conv1d_update_ref(mixed_qkv, conv_pool, params.conv_weight, batch.state_slots)
            q, k, v = shape.split(x)
            return gdn_ops.gdn_decode_ref(q, k, v, g, beta, rec_pool, batch.state_slots)
        assert batch.mode is ForwardMode.TARGET_VERIFY
        return self._verify(layer, conv_pool, rec_pool, mixed_qkv, g, beta, params, shape, batch)

    def _extend(self, conv_pool, rec_pool, mixed_qkv, g, beta, params, shape, batch):
        out = torch.empty(mixed_qkv.shape[0], shape.num_v_heads, shape.head_v_dim, dtype=torch.float32,
                          device=mixed_qkv.device)
        start = 0
        for slot, length in zip(batch.state_slots_cpu, batch.extend_lens_cpu):
            end = start + length
            conv_state = conv_pool[slot] if slot >= 0 else None
            rec_state = rec_pool[slot] if slot >= 0 else None
            x, new_conv = conv_ops.causal_conv1d_ref(mixed_qkv[start:end], conv_state, params.conv_weight)
            q, k, v = shape.split(x)
            o, new_rec = gdn_ops.chunk_gated_delta_rule_ref(q, k, v, g[start:end], beta[start:end], rec_state)
            out[start:end] = o
            if slot >= 0:
                conv_pool[slot] = new_conv.to(conv_pool.dtype)
                rec_pool[slot] = new_rec.to(rec_pool.dtype)
            start = end
        return out

    def _verify(self, layer, conv_pool, rec_pool, mixed_qkv, g, beta, params, shape, batch):
        """k + 1 steps per row from the slot's state; every step's state goes to the verify buffers."""
        pool = self.state_pool
        bs, steps = batch.batch_size, batch.tokens_per_row
        valid = batch.state_slots >= 0
        idx = batch.state_slots.clamp(min=0)
        conv0 = conv_pool[idx] * valid[:, None, None]
        rec0 = rec_pool[idx].float() * valid[:, None, None, None]
        x, conv_states = conv_ops.causal_conv1d_windows_ref(
            mixed_qkv.view(bs, steps, -1), conv0, params.conv_weight)
        q, k, v = shape.split(x)
        o, rec_states = gdn_ops.gdn_verify_ref(q, k, v, g.view(bs, steps, -1), beta.view(bs, steps, -1), rec0)
        pool.verify_conv[layer, :bs] = conv_states.to(pool.verify_conv.dtype)
        pool.verify_recurrent[layer, :bs] = rec_states.to(pool.verify_recurrent.dtype)
        return o.reshape(bs * steps, shape.num_v_heads, shape.head_v_dim)
