"""Reading a family's ``config.json``: the checks every family's parser runs before it reads a value (types and
ranges, by field name), and the fields several families write the same way (``eos_token_id``, ``layer_types``, plain
RoPE). The parsers themselves sit beside their models (``qwen3_next.py``, ``nemotron_h.py``, ...)."""

from __future__ import annotations

import math
from typing import Any


def eos_ids(value, where: str = "config.json") -> tuple[int, ...]:
    """``eos_token_id`` as written in a config (an int, a list or null) as a tuple of ids (each a non-negative
    integer; the vocabulary bound is ``ModelConfig.validate``'s)."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for v in ids:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)


# Integer fields of the families' configs (top level or text_config), and the floats that must be positive: read
# loosely (int(256.7), a true read as 1, a 0 replaced by a default) they would build a model other than the one the
# file describes. Bounds far past any released model keep a typo from allocating petabytes.
_POSITIVE_INTS = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "decoder_sparse_step",
                  "full_attention_interval", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                  "mamba_d_conv", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                  "chunk_size", "n_group", "topk_group", "mamba_chunk_size", "mamba_d_ssm"}
_COUNT_INTS = {"intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "num_nextn_predict_layers", "mtp_num_hidden_layers",
               "n_routed_experts", "n_shared_experts", "moe_shared_expert_intermediate_size", "num_local_experts",
               "shared_intermediate_size", "moe_latent_size"}
_INT_LIMITS = {"num_hidden_layers": 4096, "max_position_embeddings": 1 << 27, "vocab_size": 1 << 24}
_POSITIVE_FLOATS = {"rms_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta"}
# flags the families read: JSON booleans only (transformers refuses a string here; bool("false") would be True)
_FLAGS = {"tie_word_embeddings", "norm_topk_prob", "attention_bias", "mlp_bias", "use_bias", "use_conv_bias",
          "mamba_conv_bias", "mamba_proj_bias", "mamba_norm_before_gate", "mamba_rms_norm", "projectors_bias"}


def check_config_values(cfg: dict[str, Any], where: str = "config.json") -> None:
    """Refuse (ValueError naming the field) values of the wrong type or out of range, before a family's parser
    reads them: sizes that are not positive integers, counts that are negative, non-finite or non-positive epsilons
    and RoPE bases, a partial_rotary_factor outside (0, 1], mlp_only_layers that are not layer numbers, flags that
    are not true or false."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(cfg).__name__}")
    scopes = [(cfg, "")]
    for key in ("text_config", "rope_parameters"):
        if isinstance(cfg.get(key), dict):
            scopes.append((cfg[key], f"{key}."))
            if key == "text_config" and isinstance(cfg[key].get("rope_parameters"), dict):
                scopes.append((cfg[key]["rope_parameters"], "text_config.rope_parameters."))
    for scope, prefix in scopes:
        for key, value in scope.items():
            name = f"{where}: {prefix}{key}"
            if value is None or key == "mamba_d_head" and value == "auto":  # (transformers' default: derived)
                continue
            if key in _POSITIVE_INTS or key in _COUNT_INTS:
                low = 1 if key in _POSITIVE_INTS else 0
                high = _INT_LIMITS.get(key, 1 << 22)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value != int(value) or not low <= value <= high:
                    raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
            elif key in _POSITIVE_FLOATS or key == "partial_rotary_factor":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value <= 0 or key == "partial_rotary_factor" and value > 1:
                    bound = "in (0, 1]" if key == "partial_rotary_factor" else "a positive finite number"
                    raise ValueError(f"{name} must be {bound}, got {value!r}")
            elif key in _FLAGS:
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false, got {value!r}")
            elif key == "mlp_only_layers":
                if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                          for v in value):
                    raise ValueError(f"{name} must be a list of layer numbers, got {value!r}")


def layer_types_of(cfg: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types`` of a GDN hybrid's config, or the pattern its ``full_attention_interval`` gives."""
    n_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers or any(t not in ("linear_attention", "full_attention") for t in layer_types):
        raise ValueError(f"config.json: layer_types must list {n_layers} entries of "
                         f"'linear_attention' or 'full_attention', got {list(layer_types)}")
    return layer_types


def rope_of(cfg: dict[str, Any], allowed_extra: tuple[str, ...] = (), default_partial: float = 0.25
            ) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of plain RoPE; anything else (YaRN, linear scaling, ...) is refused by
    name. ``allowed_extra``: keys of ``rope_parameters`` the family has checked itself (Qwen3.5's mrope fields);
    ``default_partial``: the family's rotary fraction where the config gives none (Qwen's quarter of each head)."""
    if cfg.get("rope_scaling"):
        raise ValueError(f"config.json: rope_scaling {cfg['rope_scaling']!r} is not supported (only plain RoPE)")
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {rope!r}")
    rope = dict(rope)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(f"config.json: rope_type {kind!r} is not supported (only 'default')")
    unknown = set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", *allowed_extra}
    if unknown:
        raise ValueError(f"config.json: rope_parameters {sorted(unknown)} are not supported (only plain RoPE)")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return theta, float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial)))


def full_rope_of(cfg: dict[str, Any], name: str) -> float:
    """rope_theta of plain RoPE over whole heads (the Mamba2 families' attention): ``rope_of``'s refusals, and a
    partial rotary fraction refused too."""
    theta, partial = rope_of(cfg, default_partial=1.0)
    if partial != 1.0:
        raise ValueError(f"{name}: partial_rotary_factor {partial} is not supported (RoPE over whole heads only)")
    return theta
