"""Gated full attention (Qwen3-Next, Qwen3.5): per-head q/k RMSNorm, partial rotary, output times sigmoid(gate).

At load time ``q_proj`` (query and gate interleaved per head), ``k_proj`` and ``v_proj`` are fused into one
projection laid out ``[q | gate | k | v]``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..core import ForwardBatch
from .weights import TensorReader, copy_into, fp8_block_of, load_proj, proj_weight
from ..ops.linear import dense, out_proj
from ..ops.norm import rms_norm
from ..ops.triton_utils import use_triton
from .rotary import RotaryEmbedding


class GatedAttention(nn.Module):
    def __init__(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        self.hidden = mc.hidden_size
        self.eps = mc.rms_norm_eps
        self.scaling = self.head_dim ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        kw = dict(dtype=dtype, device=device)
        self.dtype, fp8 = dtype, fp8_block_of(mc)
        rows = 2 * self.q_size + 2 * self.kv_size
        self.qkv_proj = proj_weight((rows, self.hidden), dtype, fp8, device)
        self.qkv_bias = (nn.Parameter(torch.empty(rows, **kw), requires_grad=False) if mc.attention_bias else None)
        self.o_proj = proj_weight((self.hidden, self.q_size), dtype, fp8, device)
        self.o_bias = nn.Parameter(torch.empty(self.hidden, **kw), requires_grad=False) if mc.attention_bias else None
        self.q_norm = nn.Parameter(torch.empty(self.head_dim, **kw), requires_grad=False)
        self.k_norm = nn.Parameter(torch.empty(self.head_dim, **kw), requires_grad=False)
        self.rotary = RotaryEmbedding(mc.rotary_dim, mc.rope_theta, device=device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend, reduce: bool = True) -> torch.Tensor:
        """[T, hidden]; with ``reduce=False`` possibly unreduced rows [T, S, hidden] (see ``ops.linear``)."""
        num_tokens = x.shape[0]
        proj = dense(x, self.qkv_proj, self.qkv_bias)
        q, gate, k, v = proj.split([self.q_size, self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if use_triton(proj):  # norms and rotary in one kernel, straight from the projection
            from ..ops.norm_triton import qk_norm_rope

            # the new keys and values straight into the pool where the backend allows it (k then comes back None)
            q, k = qk_norm_rope(proj, batch.positions, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads,
                                self.head_dim, self.rotary.rotary_dim, self.rotary.inv_freq, self.eps,
                                2 * self.q_size, kv_store=backend.kv_store(self.layer_id, batch, proj.dtype))
            if k is None:
                v = None
        else:
            q = rms_norm(q.reshape(num_tokens, self.num_heads, self.head_dim), self.q_norm, self.eps)
            k = rms_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim), self.k_norm, self.eps)
            q, k = self.rotary(batch.positions, q, k)
        # [T, H, D] times sigmoid(gate): on the decode path inside the split attention's merge (in the output
        # projection's loads the gate made that GEMV 2.2x slower: 13.4 against 6.0 us at batch 1 on the H200)
        out = backend.attention(self.layer_id, q, k, v, batch, self.scaling, gate=gate)
        return out_proj(out.reshape(num_tokens, self.q_size), self.o_proj, self.o_bias, reduce=reduce)

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, backend) -> None:
        """Only the new tokens' keys and values into the KV pool (the MTP head's plain-decode bookkeeping): the
        projection's key and value rows, the key norm and rotary, no attention."""
        n = x.shape[0]
        if isinstance(self.qkv_proj, torch.Tensor):  # the key and value rows alone (a view: [q | gate | k | v])
            w, bias = self.qkv_proj[2 * self.q_size:], self.qkv_bias
            kv = dense(x, w, None if bias is None else bias[2 * self.q_size:])
        else:  # block-FP8 weights: the whole projection (its blocks need not split at the key rows)
            kv = dense(x, self.qkv_proj, self.qkv_bias)
        store = backend.kv_store(self.layer_id, batch, kv.dtype) if use_triton(kv) else None
        if store is not None:  # the key norm, rotary and both stores in one launch (no query heads)
            from ..ops.norm_triton import qk_norm_rope

            qk_norm_rope(kv, batch.positions, self.q_norm, self.k_norm, 0, self.num_kv_heads, self.head_dim,
                         self.rotary.rotary_dim, self.rotary.inv_freq, self.eps, kv.shape[-1] - 2 * self.kv_size,
                         kv_store=store)
            return
        k, v = kv[..., -2 * self.kv_size:].split([self.kv_size, self.kv_size], dim=-1)
        k = rms_norm(k.reshape(n, self.num_kv_heads, self.head_dim), self.k_norm, self.eps)
        k = self.rotary.rotate(batch.positions, k)
        backend.store_kv(self.layer_id, k, v.reshape(n, self.num_kv_heads, self.head_dim), batch)

    def load(self, r: TensorReader, prefix: str) -> None:
        h, d = self.num_heads, self.head_dim

        def qkv(rd: TensorReader) -> torch.Tensor:
            qg = rd.get(f"{prefix}.q_proj.weight", (2 * self.q_size, self.hidden)).view(h, 2 * d, self.hidden)
            k = rd.get(f"{prefix}.k_proj.weight", (self.kv_size, self.hidden))
            v = rd.get(f"{prefix}.v_proj.weight", (self.kv_size, self.hidden))
            q, gate = qg[:, :d].reshape(-1, self.hidden), qg[:, d:].reshape(-1, self.hidden)
            return torch.cat([q, gate, k, v], dim=0)

        load_proj(self, "qkv_proj", r, qkv, self.dtype)
        if self.qkv_bias is not None:
            qgb = r.get(f"{prefix}.q_proj.bias", (2 * self.q_size,)).view(h, 2 * d)
            copy_into(self.qkv_bias, torch.cat([qgb[:, :d].reshape(-1), qgb[:, d:].reshape(-1),
                                                r.get(f"{prefix}.k_proj.bias", (self.kv_size,)),
                                                r.get(f"{prefix}.v_proj.bias", (self.kv_size,))]))
            copy_into(self.o_bias, r.get(f"{prefix}.o_proj.bias", (self.hidden,)))
        load_proj(self, "o_proj", r, lambda rd: rd.get(f"{prefix}.o_proj.weight", (self.hidden, self.q_size)),
                  self.dtype)
        copy_into(self.q_norm, r.get(f"{prefix}.q_norm.weight", (d,)))
        copy_into(self.k_norm, r.get(f"{prefix}.k_norm.weight", (d,)))


class Attention(nn.Module):
    """Plain multi-head attention with grouped KV heads, no q/k norm, no output gate, and rotary on the whole head
    where ``mc.rotary_dim`` says so (Granite-4.0-H's with RoPE, Falcon-H1's) or no positional encoding
    (Nemotron-H's); scores
    scaled by ``scaling`` (default 1/sqrt(head_dim)). ``q_proj``, ``k_proj`` and ``v_proj`` are fused at load into
    one ``[q | k | v]`` projection."""

    def __init__(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device=None, scaling: float | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
        self.hidden = mc.hidden_size
        self.scaling = self.head_dim ** -0.5 if scaling is None else scaling
        self.rotary = RotaryEmbedding(mc.rotary_dim, mc.rope_theta, device=device) if mc.rotary_dim else None
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kw = dict(dtype=dtype, device=device)
        rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Parameter(torch.empty(rows, self.hidden, **kw), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.empty(rows, **kw), requires_grad=False) if mc.attention_bias else None
        self.o_proj = nn.Parameter(torch.empty(self.hidden, self.q_size, **kw), requires_grad=False)
        self.o_bias = nn.Parameter(torch.empty(self.hidden, **kw), requires_grad=False) if mc.attention_bias else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend, reduce: bool = True) -> torch.Tensor:
        """[T, hidden]; with ``reduce=False`` possibly unreduced rows [T, S, hidden] (see ``ops.linear``)."""
        n = x.shape[0]
        q, k, v = dense(x, self.qkv_proj, self.qkv_bias).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(n, self.num_heads, self.head_dim), k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        out = backend.attention(self.layer_id, q, k, v.reshape(n, self.num_kv_heads, self.head_dim), batch,
                                self.scaling)
        return out_proj(out.reshape(n, self.q_size), self.o_proj, self.o_bias, reduce=reduce)

    def load(self, r: TensorReader, prefix: str) -> None:
        parts = [("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)]
        copy_into(self.qkv_proj, torch.cat([r.get(f"{prefix}.{p}_proj.weight", (rows, self.hidden))
                                            for p, rows in parts]))
        copy_into(self.o_proj, r.get(f"{prefix}.o_proj.weight", (self.hidden, self.q_size)))
        if self.qkv_bias is not None:
            copy_into(self.qkv_bias, torch.cat([r.get(f"{prefix}.{p}_proj.bias", (rows,)) for p, rows in parts]))
            copy_into(self.o_bias, r.get(f"{prefix}.o_proj.bias", (self.hidden,)))
