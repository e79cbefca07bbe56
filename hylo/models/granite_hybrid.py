"""Granite-4.0-H (``granitemoehybrid``): Mamba2 or attention (RoPE, or no positional encoding where
``position_embedding_type`` says so) per layer, each followed by a MoE whose output adds a shared SwiGLU MLP's (or
that MLP alone where the config has no experts), with the muP multipliers on the embeddings, every residual
branch, the attention scores and the logits. Names as released: ``block_sparse_moe.{router.layer, input_linear,
output_linear}``, ``shared_mlp.{input_linear, output_linear}``, ``mamba.*`` / ``self_attn.*`` under ``model.``.

Not yet served, refused before a weight is read: tensor parallelism, RoPE scaling other than the default.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Mamba2Spec, ModelConfig, MuP
from ..core import ForwardBatch
from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.moe import MLP
from ..layers.weights import TensorReader, copy_into
from ..ops.moe import fused_moe, route_hidden
from ..ops.norm import rms_norm_plain
from .hf_config import eos_ids, full_rope_of
from .stack import LayerStack, json_float, mamba2_model_config

MODEL_TYPES = ("granitemoehybrid",)
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    """A Granite-4.0-H ``config.json`` (as transformers 5.24 writes it, or as released) as hylo's ModelConfig."""
    name = "granitemoehybrid config"
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if not types:  # transformers' default: every layer a Mamba2 layer
        if not cfg.get("num_hidden_layers"):
            raise ValueError(f"{name}: neither layer_types (or layers_block_type) nor num_hidden_layers is set")
        types = ["mamba"] * cfg["num_hidden_layers"]
    types = tuple(LEGACY.get(t, t) for t in types)
    if cfg.get("num_hidden_layers") is not None and cfg["num_hidden_layers"] != len(types):
        raise ValueError(f"{name}: num_hidden_layers is {cfg['num_hidden_layers']}, but layer_types lists "
                         f"{len(types)} layers")
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{name}: unknown layer types {unknown}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
    hidden = cfg.get("hidden_size", 4096)
    heads = cfg.get("mamba_n_heads", 128)
    head_dim = cfg.get("mamba_d_head")
    if head_dim in (None, "auto"):  # transformers derives it
        head_dim = int(cfg.get("mamba_expand", 2) * hidden) // heads
    if heads * head_dim != int(cfg.get("mamba_expand", 2) * hidden):
        raise ValueError(f"{name}: mamba_n_heads * mamba_d_head = {heads * head_dim} is not mamba_expand * "
                         f"hidden_size = {int(cfg.get('mamba_expand', 2) * hidden)}")
    limit = tuple(json_float(v) for v in cfg.get("time_step_limit") or (0.0, float("inf")))
    mamba = Mamba2Spec(num_heads=heads, head_dim=head_dim, n_groups=cfg.get("mamba_n_groups", 1),
                       state_size=cfg.get("mamba_d_state", 256), conv_kernel=cfg.get("mamba_d_conv", 4),
                       conv_bias=cfg.get("mamba_conv_bias", True), proj_bias=cfg.get("mamba_proj_bias", False),
                       norm_eps=cfg.get("rms_norm_eps", 1e-6), dt_limit=limit,
                       chunk_size=cfg.get("mamba_chunk_size", 256))
    use_rope = cfg.get("position_embedding_type", "nope") == "rope"
    theta = full_rope_of(cfg, name) if use_rope else 10000.0
    attn_heads = cfg.get("num_attention_heads", 32)
    experts = cfg.get("num_local_experts", 0) or 0
    return mamba2_model_config(
        mamba, vocab_size=cfg.get("vocab_size", 32000), hidden_size=hidden, num_hidden_layers=len(types),
        layer_types=types, num_attention_heads=attn_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or attn_heads,
        head_dim=cfg.get("head_dim") or hidden // attn_heads,
        rope_theta=theta, partial_rotary_factor=1.0 if use_rope else 0.0,
        attention_bias=bool(cfg.get("attention_bias", False)),
        intermediate_size=cfg.get("shared_intermediate_size", 1024),
        num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 2) if experts else 0,
        moe_intermediate_size=cfg.get("intermediate_size", 1024) if experts else 0, norm_topk_prob=True,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids(cfg.get("eos_token_id")), hidden_act="silu",
        model_type=cfg.get("model_type", "granitemoehybrid"),
        mup=MuP(embedding=float(cfg.get("embedding_multiplier", 1.0)),
                residual=float(cfg.get("residual_multiplier", 1.0)),
                attention=float(cfg.get("attention_multiplier", 1.0)),
                logits=float(cfg.get("logits_scaling", 1.0))))


class GraniteMoE(nn.Module):
    """Routed SwiGLU experts (softmax over the top-k router logits, which is the softmax over all renormalised on
    the top k) through hylo's MoE kernels."""

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device=None):
        super().__init__()
        self.hidden, self.inter = mc.hidden_size, mc.moe_intermediate_size
        self.num_experts, self.top_k = mc.num_experts, mc.num_experts_per_tok
        kw = dict(dtype=dtype, device=device)
        self.router = nn.Parameter(torch.empty(self.num_experts, self.hidden, **kw), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.inter, self.hidden, **kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_experts, self.hidden, self.inter, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_hidden(x, self.router, self.num_experts, self.top_k, True, False)
        return fused_moe(x, self.w13, self.w2, weights, ids)

    def load(self, r: TensorReader, prefix: str) -> None:
        E, H, I = self.num_experts, self.hidden, self.inter
        copy_into(self.router, r.get(f"{prefix}.router.layer.weight", (E, H)))
        copy_into(self.w13, r.get(f"{prefix}.input_linear.weight", (E, 2 * I, H)))  # gate rows, then up rows
        copy_into(self.w2, r.get(f"{prefix}.output_linear.weight", (E, H, I)))


class GraniteLayer(nn.Module):
    def __init__(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.is_linear = mc.layer_types[layer_id] == "linear_attention"
        self.eps, self.residual = mc.rms_norm_eps, mc.mup.residual
        kw = dict(dtype=dtype, device=device)
        self.input_norm = nn.Parameter(torch.empty(mc.hidden_size, **kw), requires_grad=False)
        self.post_norm = nn.Parameter(torch.empty(mc.hidden_size, **kw), requires_grad=False)
        self.mixer = (Mamba2Mixer(mc.hidden_size, mc.mamba, layer_id, dtype, device) if self.is_linear
                      else Attention(mc, layer_id, dtype, device, scaling=mc.mup.attention))
        self.moe = GraniteMoE(mc, dtype, device) if mc.num_experts else None
        self.shared_mlp = MLP(mc.hidden_size, mc.intermediate_size, dtype, device)

    def _norm(self, h, w):
        return rms_norm_plain(h, w, self.eps, weight_in_float32=False)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, backend) -> torch.Tensor:
        h = h + self.mixer(self._norm(h, self.input_norm), batch, backend) * self.residual
        x = self._norm(h, self.post_norm)
        out = self.shared_mlp(x) if self.moe is None else self.moe(x) + self.shared_mlp(x)
        return h + out * self.residual

    def load(self, r: TensorReader, prefix: str) -> None:
        copy_into(self.input_norm, r.get(f"{prefix}.input_layernorm.weight", tuple(self.input_norm.shape)))
        copy_into(self.post_norm, r.get(f"{prefix}.post_attention_layernorm.weight", tuple(self.post_norm.shape)))
        self.mixer.load(r, f"{prefix}.mamba" if self.is_linear else f"{prefix}.self_attn")
        if self.moe is not None:
            self.moe.load(r, f"{prefix}.block_sparse_moe")
        self.shared_mlp.load_fused(r, f"{prefix}.shared_mlp.input_linear.weight",
                                   f"{prefix}.shared_mlp.output_linear.weight")


class GraniteMoeHybridForCausalLM(LayerStack):
    family = "Granite-4.0-H"

    def make_layer(self, mc, layer_id, dtype, device):
        return GraniteLayer(mc, layer_id, dtype, device)
