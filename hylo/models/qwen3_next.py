"""Qwen3-Next (``model_type`` ``qwen3_next``): Gated DeltaNet and gated full-attention layers (``layer_types``),
each followed by a sparse MoE with a sigmoid-gated shared expert (or a dense MLP where ``mlp_only_layers`` or
``decoder_sparse_step`` say so). Text model under ``model.*``, MTP head under ``mtp.*``.

What is particular to its checkpoints: the GDN input projections are grouped per key head on disk
(``in_proj_qkvz``: q, k, v, z of each key head together; ``in_proj_ba``: b, a of each key head together).
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends.gdn import GDNShape
from ..config import ModelConfig
from ..layers.weights import TensorReader
from .hf_config import eos_ids, layer_types_of, rope_of
from .hybrid import HybridForCausalLM


def parse_gdn_hybrid(cfg: dict[str, Any], model_type: str, rope_extra: tuple[str, ...] = ()) -> ModelConfig:
    """A GDN hybrid's text config (Qwen3-Next's keys; Qwen3.5's text config uses the same ones)."""
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_theta, prf = rope_of(cfg, rope_extra)
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        layer_types=layer_types_of(cfg),
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads", num_heads)),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rope_theta=rope_theta,
        partial_rotary_factor=prf,
        attention_bias=bool(cfg.get("attention_bias", False)),
        linear_num_key_heads=int(cfg["linear_num_key_heads"]),
        linear_num_value_heads=int(cfg["linear_num_value_heads"]),
        linear_key_head_dim=int(cfg["linear_key_head_dim"]),
        linear_value_head_dim=int(cfg["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
        num_experts=int(cfg.get("num_experts", 0) or 0),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids(cfg.get("eos_token_id")),
        num_nextn_predict_layers=_mtp_layers(cfg),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        model_type=model_type,
    )


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    return parse_gdn_hybrid(cfg, "qwen3_next")


class Qwen3NextForCausalLM(HybridForCausalLM):
    family = "Qwen3-Next"

    @staticmethod
    def read_in_proj(r: TensorReader, prefix: str, s: GDNShape, hidden: int) -> torch.Tensor:
        """``in_proj_qkvz`` [Hk * (2 Dk + 2 rep Dv), H] and ``in_proj_ba`` [Hk * 2 rep, H], grouped per key head,
        re-laid as [q | k | v | z | b | a] (value head j follows key head j // rep in both)."""
        nk, dk, rep, dv = s.num_k_heads, s.head_k_dim, s.num_v_heads // s.num_k_heads, s.head_v_dim
        group = 2 * dk + 2 * rep * dv
        qkvz = r.get(f"{prefix}.in_proj_qkvz.weight", (nk * group, hidden)).view(nk, group, hidden)
        q, k, v, z = qkvz.split([dk, dk, rep * dv, rep * dv], dim=1)
        ba = r.get(f"{prefix}.in_proj_ba.weight", (2 * s.num_v_heads, hidden)).view(nk, 2 * rep, hidden)
        b, a = ba.split([rep, rep], dim=1)
        return torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z, b, a)], dim=0)


def _mtp_layers(cfg: dict[str, Any]) -> int:
    """The MTP head's layers: the config's count where it writes one (0: none), else one (the releases write
    none and have one; transformers' configs do not know the field)."""
    value = cfg.get("num_nextn_predict_layers", cfg.get("mtp_num_hidden_layers"))
    return 1 if value is None else int(value)
