"""The embedded default models (no download).

- The trained default (``default_ckpt/`` beside this file, when present): a small Qwen3-Next-architecture model
  with an MTP head, trained on the Python standard library by ``tools/train_default.py``; a normal Hugging Face
  checkpoint directory, loaded like any other. ``model=None`` means this one.
- The random default (``model="hylo-default-random"``, or ``None`` when no trained one ships): built on the fly
  from seeded random numbers with a byte-level tokenizer. It proves the pipeline runs, and is what tests use when
  they want a fast model whose output does not matter.
"""

from __future__ import annotations

import os

from ..config import ModelConfig
from ..tokenizer import ByteTokenizer

DEFAULT_MODEL_NAME = "hylo-default-random"
DEFAULT_SEED = 1234
TRAINED_DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_ckpt")
TRAINED_DEFAULT_NAME = "hylo-stdlib-default"


def trained_default_path() -> str | None:
    """The shipped trained default's directory, or None when this install has none."""
    ok = all(os.path.isfile(os.path.join(TRAINED_DEFAULT_DIR, f)) for f in ("config.json", "model.safetensors"))
    return TRAINED_DEFAULT_DIR if ok else None


def default_model_config() -> ModelConfig:
    tok = ByteTokenizer()
    return ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        attention_bias=False,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_ids=(tok.token_id("<|endoftext|>"), tok.token_id("<|im_end|>")),
    )
