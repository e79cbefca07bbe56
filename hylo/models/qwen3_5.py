"""Qwen3.5 and Qwen3.5-MoE: the Qwen3-Next layer pattern (3 Gated DeltaNet layers to 1 gated attention layer) with
a dense SwiGLU MLP in every layer (``qwen3_5``) or a sparse MoE with a shared expert in every layer
(``qwen3_5_moe``), and an MTP head (``mtp.*``, ``mtp_num_hidden_layers``) whose layer has the same MLP kind.

Two checkpoint forms:
- as released (``qwen3_5`` / ``qwen3_5_moe``, ``Qwen3_5ForConditionalGeneration``): ``config.json`` nests the text
  model's config under ``text_config`` beside a ``vision_config``; tensors under ``model.language_model.*`` (text),
  ``model.visual.*`` (the vision tower: never read, hylo serves the text model), ``lm_head.*`` and ``mtp.*``;
- text only (``qwen3_5_text`` / ``qwen3_5_moe_text``, ``Qwen3_5ForCausalLM``): a flat config, tensors under
  ``model.*``.
What differs from Qwen3-Next on disk: the GDN input projections are four separate tensors in natural head order
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), experts may be stored fused (handled by the MoE
layer), and RoPE is written as multimodal RoPE (``mrope_section``, ``mrope_interleaved``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..backends.gdn import GDNShape
from ..config import ModelConfig
from ..layers.weights import TensorReader
from .hf_config import eos_ids
from .hybrid import HybridForCausalLM
from .qwen3_next import parse_gdn_hybrid

VISION_PREFIX = "model.visual."
MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")
TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg["model_type"]
    if model_type in MULTIMODAL_TYPES:
        text = dict(cfg.get("text_config") or {})
        if not text:
            raise ValueError(f"config.json: model_type {model_type!r} needs a 'text_config'")
    else:
        text = dict(cfg)  # (updated below: the caller's dict stays as it was)
    moe = model_type in ("qwen3_5_moe", "qwen3_5_moe_text")
    rope = dict(text.get("rope_parameters") or {})
    _check_mrope(rope, text)
    # No key of Qwen3-Next's MoE placement applies: a dense model has no experts, a MoE model has them in every
    # layer, and its router always renormalises the top-k weights.
    text.update(num_experts=text.get("num_experts", 0) if moe else 0, decoder_sparse_step=1, mlp_only_layers=[],
                norm_topk_prob=True)
    if moe and not int(text.get("num_experts") or 0):
        raise ValueError(f"config.json: {model_type!r} needs num_experts > 0")
    if not moe and not int(text.get("intermediate_size") or 0):
        raise ValueError(f"config.json: {model_type!r} needs intermediate_size > 0 (its dense MLP)")
    mc = parse_gdn_hybrid(text, model_type, rope_extra=("mrope_section", "mrope_interleaved"))
    if model_type in MULTIMODAL_TYPES:
        # transformers ties the LM head by the outer config's flag alone (False where it is missing: the
        # text_config's flag is not read); the stop ids of both levels apply
        tie = bool(cfg.get("tie_word_embeddings", False))
        eos = tuple(dict.fromkeys(eos_ids(cfg.get("eos_token_id")) + mc.eos_token_ids))
        mc = replace(mc, tie_word_embeddings=tie, eos_token_ids=eos)
    return mc


def _check_mrope(rope: dict, text: dict) -> None:
    """Qwen3.5 writes its RoPE as multimodal RoPE: the rotary frequencies are split into sections (``mrope_section``,
    for the temporal, height and width position of a token), optionally interleaved. For text every token's three
    position components are equal (its position in the sequence), so whichever section a frequency belongs to it
    rotates by the same position: this is plain (partial) RoPE over ``head_dim * partial_rotary_factor`` channels,
    which is what hylo computes. The sections must still cover those frequencies exactly."""
    section = rope.get("mrope_section")
    if section is None:
        return
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
    rotary_pairs = int(head_dim * float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))) // 2
    if not isinstance(section, list) or sum(int(x) for x in section) != rotary_pairs:
        raise ValueError(f"config.json: mrope_section {section!r} must sum to the rotary frequencies "
                         f"(head_dim * partial_rotary_factor / 2 = {rotary_pairs})")


class Qwen3_5ForCausalLM(HybridForCausalLM):
    family = "Qwen3.5"

    @staticmethod
    def read_in_proj(r: TensorReader, prefix: str, s: GDNShape, hidden: int) -> torch.Tensor:
        """``in_proj_qkv`` [2 Hk Dk + Hv Dv, H] (q, k, v of all heads in order), ``in_proj_z`` [Hv Dv, H],
        ``in_proj_b`` and ``in_proj_a`` [Hv, H]: already hylo's order, so one concatenation."""
        kd, vd, hv = s.key_dim, s.num_v_heads * s.head_v_dim, s.num_v_heads
        return torch.cat([r.get(f"{prefix}.in_proj_qkv.weight", (2 * kd + vd, hidden)),
                          r.get(f"{prefix}.in_proj_z.weight", (vd, hidden)),
                          r.get(f"{prefix}.in_proj_b.weight", (hv, hidden)),
                          r.get(f"{prefix}.in_proj_a.weight", (hv, hidden))], dim=0)

    @staticmethod
    def text_prefix(r: TensorReader) -> str:
        return "model.language_model" if r.has("model.language_model.embed_tokens.weight") else "model"
