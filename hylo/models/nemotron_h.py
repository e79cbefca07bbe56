"""Nemotron-H (NVIDIA Nemotron-H, Nemotron Nano 2): a stack of blocks, each one pre-norm mixer with a residual add:
Mamba2 (``M``), full attention without positional encoding (``*``), or a squared-ReLU MLP (``-``), as
``layers_block_type`` (or the older ``hybrid_override_pattern``) lists them. Tensors live under ``backbone.``.

Nemotron 3's MoE blocks (``E``: grouped sigmoid routing, non-gated squared-ReLU experts, a latent projection, a
shared expert; ``layers.mlp.GroupedSigmoidMoE``) run on the CPU and, through the expert kernels' non-gated mode, on
the GPU. Refused by name: tensor parallelism. The MTP layers a checkpoint may carry (Nemotron 3 Super's) are the
MTP drafter's model (``models.nemotron_mtp``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import GroupedRouter, Mamba2Spec, ModelConfig
from ..core import ForwardBatch
from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.mlp import GroupedSigmoidMoE, SquaredReluMLP
from ..layers.weights import TensorReader, copy_into
from ..ops.norm import add_rms_norm, rms_norm_plain
from .hf_config import eos_ids
from .stack import LayerStack, mamba2_model_config

MODEL_TYPES = ("nemotron_h",)
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def _pattern_types(pattern: str, key: str) -> list[str]:
    """The block types a pattern's letters name (config key ``key``); an unknown letter is refused by name."""
    unknown = sorted(set(pattern) - set(PATTERN))
    if unknown:
        raise ValueError(f"nemotron_h config: {key} has unknown block letters {unknown} (known: {', '.join(PATTERN)})")
    return [PATTERN[c] for c in pattern]


def _block_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("hybrid_override_pattern")
        if not pattern:
            raise ValueError("nemotron_h config: neither layers_block_type nor hybrid_override_pattern is set")
        types = _pattern_types(pattern, "hybrid_override_pattern")
    types = tuple(LEGACY.get(t, t) for t in types)
    unknown = sorted(set(types) - set(PATTERN.values()))
    if unknown:
        raise ValueError(f"nemotron_h config: unknown block types {unknown}")
    return types


def _mtp_block_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The MTP head's blocks (``mtp_layers_block_type``, or the older ``mtp_hybrid_override_pattern``), () when the
    checkpoint has no MTP layers."""
    if not cfg.get("num_nextn_predict_layers"):
        return ()
    types = cfg.get("mtp_layers_block_type")
    if types is None:
        types = _pattern_types(cfg.get("mtp_hybrid_override_pattern", "*E"), "mtp_hybrid_override_pattern")
    return tuple(LEGACY.get(t, t) for t in types)


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    """A Nemotron-H ``config.json`` (as transformers 5.24 writes it, or as released) as hylo's ModelConfig."""
    types = _block_types(cfg)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise ValueError(f"nemotron_h config: {key}={cfg[key]!r} is not supported (only {want!r})")
    if cfg.get("mlp_bias"):
        raise ValueError("nemotron_h config: mlp_bias=true is not supported")
    heads = cfg.get("num_attention_heads", 32)
    hidden = cfg.get("hidden_size", 4096)
    mamba = Mamba2Spec(
        num_heads=cfg.get("mamba_num_heads", 128), head_dim=cfg.get("mamba_head_dim", 64),
        n_groups=cfg.get("n_groups", cfg.get("mamba_n_groups", 8)),
        state_size=cfg.get("ssm_state_size", 128), conv_kernel=cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)),
        conv_bias=cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True)), proj_bias=cfg.get("use_bias", False),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        # transformers' mixer clamps the prefill's dt from below at time_step_min, never above
        dt_limit=(float(cfg.get("time_step_min", cfg.get("mamba_dt_min", 0.001))), float("inf")),
        chunk_size=cfg.get("chunk_size", cfg.get("mamba_chunk_size", 128)))
    moe = {}
    if "moe" in types:
        if cfg.get("n_shared_experts", 1) != 1:
            raise ValueError(f"nemotron_h config: n_shared_experts={cfg['n_shared_experts']} is not supported (only 1)")
        moe = dict(num_experts=cfg.get("n_routed_experts", 8), num_experts_per_tok=cfg.get("num_experts_per_tok", 2),
                   moe_intermediate_size=cfg.get("moe_intermediate_size", 7688),
                   shared_expert_intermediate_size=cfg.get("moe_shared_expert_intermediate_size", 7688),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   router=GroupedRouter(n_group=cfg.get("n_group", 1), topk_group=cfg.get("topk_group", 1),
                                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                                        latent_size=cfg.get("moe_latent_size")))
    return mamba2_model_config(
        mamba, vocab_size=cfg.get("vocab_size", 131072), hidden_size=hidden, num_hidden_layers=len(types),
        layer_types=types, num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, rope_theta=0.0, partial_rotary_factor=0.0,
        # transformers' NemotronH reads neither flag: its attention has no biases whatever attention_bias says, and
        # its lm_head is its own tensor even under tie_word_embeddings (no tied keys): so are hylo's
        attention_bias=False, intermediate_size=cfg.get("intermediate_size", 21504),
        rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=False, eos_token_ids=eos_ids(cfg.get("eos_token_id")),
        hidden_act="relu2", model_type=cfg.get("model_type", "nemotron_h"),
        num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0), mtp_layer_types=_mtp_block_types(cfg),
        **moe)


class Block(nn.Module):
    """Pre-norm, one mixer, residual add (in the activations' dtype, as the reference does)."""

    def __init__(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device=None, kind: str | None = None):
        super().__init__()
        self.kind = kind or mc.layer_types[layer_id]  # (an MTP head's blocks name their kind)
        self.eps = mc.rms_norm_eps
        self.norm = nn.Parameter(torch.empty(mc.hidden_size, dtype=dtype, device=device), requires_grad=False)
        if self.kind == "linear_attention":
            self.mixer = Mamba2Mixer(mc.hidden_size, mc.mamba, layer_id, dtype, device)
        elif self.kind == "full_attention":
            self.mixer = Attention(mc, layer_id, dtype, device)
        elif self.kind == "moe":
            self.mixer = GroupedSigmoidMoE(mc, dtype, device)
        else:
            self.mixer = SquaredReluMLP(mc.hidden_size, mc.intermediate_size, dtype, device)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, backend) -> torch.Tensor:
        return h + self.mix(rms_norm_plain(h, self.norm, self.eps), batch, backend)

    def mix(self, x: torch.Tensor, batch: ForwardBatch, backend, reduce: bool = True) -> torch.Tensor:
        """The mixer on the normed input; ``reduce=False``: its output may come as rows for the residual add to
        sum (``ops.norm.add_rms_norm``)."""
        if self.kind in ("mlp", "moe"):
            return self.mixer(x, reduce=reduce)
        return self.mixer(x, batch, backend, reduce=reduce)

    def load(self, r: TensorReader, prefix: str) -> None:
        copy_into(self.norm, r.get(f"{prefix}.norm.weight", tuple(self.norm.shape)))
        self.mixer.load(r, f"{prefix}.mixer")


class NemotronHForCausalLM(LayerStack):
    family = "Nemotron-H"
    EMBED, LAYERS, FINAL_NORM = "backbone.embeddings.weight", "backbone.layers", "backbone.norm_f.weight"

    def make_layer(self, mc, layer_id, dtype, device):
        return Block(mc, layer_id, dtype, device)

    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        """``LayerStack.forward`` with each residual add done by the next block's norm (one launch for both on the
        GPU, which also sums the mixers' unreduced output rows: no reduction or cast launch of their own)."""
        h, delta, eps = self.embed_tokens(batch.input_ids), None, self.config.rms_norm_eps
        for layer in self.layers:
            if delta is None:
                x = rms_norm_plain(h, layer.norm, eps)
            else:
                h, x = add_rms_norm(h, delta, layer.norm, eps, plain=True)
            delta = layer.mix(x, batch, backend, reduce=False)
        return add_rms_norm(h, delta, self.norm, eps, plain=True)[1]
