"""The model registry: ``model_type`` -> its family (config parser, target model class, MTP head class).

The engine asks this module for everything family-specific and never imports a family by name. A new family is one
file under ``models/`` plus one ``Family`` entry here. An unknown ``model_type`` is refused before any weight is
read, with the list of the supported ones.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import ModelConfig
from . import falcon_h1, granite_hybrid, nemotron_h, qwen3_5, qwen3_next
from .hf_config import check_config_values, eos_ids
from .causal_lm import CausalLM
from .loader import read_json
from .mtp import MTPHead
from .nemotron_mtp import NemotronMTPHead
from .quant import parse_quantization


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    parse: Callable[[dict[str, Any]], ModelConfig]  # config.json (as a dict) -> the text model's config
    model: type[CausalLM]  # model(config, dtype, device, tp)
    mtp: type[MTPHead | NemotronMTPHead] | None  # mtp(config, target, dtype, device); None: no MTP head here
    # checkpoint tensors the family never reads, with what they are (reported once at start-up)
    ignored: tuple[tuple[str, str], ...] = ()
    # how the family's transformers classes begin (config.json's "architectures": a config whose classes are all
    # another family's contradicts its model_type, and is refused rather than read as this family)
    architectures: tuple[str, ...] = ()


FAMILIES = (
    Family("Qwen3-Next", ("qwen3_next",), qwen3_next.parse_config, qwen3_next.Qwen3NextForCausalLM, MTPHead,
           architectures=("Qwen3Next",)),
    Family("Qwen3.5", qwen3_5.MULTIMODAL_TYPES + qwen3_5.TEXT_TYPES, qwen3_5.parse_config,
           qwen3_5.Qwen3_5ForCausalLM, MTPHead, ignored=((qwen3_5.VISION_PREFIX, "the vision tower"),),
           architectures=("Qwen3_5",)),
    Family("Nemotron-H", nemotron_h.MODEL_TYPES, nemotron_h.parse_config, nemotron_h.NemotronHForCausalLM,
           NemotronMTPHead, architectures=("NemotronH",)),
    Family("Granite-4.0-H", granite_hybrid.MODEL_TYPES, granite_hybrid.parse_config,
           granite_hybrid.GraniteMoeHybridForCausalLM, None, architectures=("GraniteMoeHybrid",)),
    Family("Falcon-H1", falcon_h1.MODEL_TYPES, falcon_h1.parse_config, falcon_h1.FalconH1ForCausalLM, None,
           architectures=("FalconH1",)),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported_model_types() -> list[str]:
    return list(_BY_TYPE)


def family_of(model_type: str | None) -> Family:
    if not isinstance(model_type, str) or model_type not in _BY_TYPE:
        known = ", ".join(f"{t!r} ({f.name})" for t, f in _BY_TYPE.items())
        raise ValueError(f"unsupported model_type {model_type!r}: hylo serves {known}")
    return _BY_TYPE[model_type]


def has_mtp_head(mc: ModelConfig) -> bool:
    """Whether ``mc`` carries an MTP head hylo can draft with: its family has one and this checkpoint's layers."""
    return family_of(mc.model_type).mtp is not None and mc.num_nextn_predict_layers > 0


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    """A ``config.json``'s contents as hylo's ModelConfig, checked (an unsupported family, shape or quantization is
    a ValueError naming it)."""
    check_config_values(cfg)
    family = family_of(cfg.get("model_type"))
    archs = cfg.get("architectures")
    if (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs) and family.architectures
            and not any(a.startswith(family.architectures) for a in archs)):
        raise ValueError(f"config.json: architectures {archs} are not {family.name} classes, but model_type "
                         f"{cfg.get('model_type')!r} is: the config contradicts itself")
    try:
        mc = family.parse(cfg)
    except KeyError as e:
        raise ValueError(f"config.json has no {e.args[0]!r}, which a {family.name} config needs") from None
    except (TypeError, ZeroDivisionError) as e:  # a value of a shape the family's parser cannot read
        raise ValueError(f"config.json: a value the {family.name} config cannot hold ({e})") from None
    mc = replace(mc, quantization=parse_quantization(cfg))
    if mc.quantization is not None and mc.mamba is not None:
        raise ValueError(f"quantized {family.name} checkpoints are not supported yet (block FP8 is served for the "
                         f"Qwen families only)")
    mc.validate()
    return mc


def untie_where_the_head_differs(mc: ModelConfig, reader) -> ModelConfig:
    """transformers' rule for a config that ties the LM head to the embeddings while the checkpoint holds both
    tensors: tied only where they are equal; where they differ the config is taken to be wrong, and the stored
    ``lm_head.weight`` computes the logits (the two tensors are read here, once, to compare them)."""
    if not mc.tie_word_embeddings or not reader.has("lm_head.weight"):
        return mc
    embed = family_of(mc.model_type).model.embed_name(reader)
    if reader.has(embed) and reader.shape_of(embed) == reader.shape_of("lm_head.weight") and torch.equal(
            reader.get(embed), reader.get("lm_head.weight")):
        return mc
    print("[hylo] warning: config.json ties the LM head to the embeddings, but the checkpoint holds a different "
          "lm_head.weight: it is used (transformers does the same); set tie_word_embeddings to false to say so",
          file=sys.stderr)
    return replace(mc, tie_word_embeddings=False)


def read_config(path: str) -> ModelConfig:
    """The model config of a checkpoint directory: ``config.json``, with the stop ids of
    ``generation_config.json`` added (chat models stop on several ids)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    mc = parse_config(read_json(cfg_path))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = read_json(gen_path)
        if not isinstance(gen, dict):
            raise ValueError(f"{gen_path} must hold a JSON object, got {type(gen).__name__}")
        eos = eos_ids(gen.get("eos_token_id"), "generation_config.json")
        mc = replace(mc, eos_token_ids=tuple(dict.fromkeys(mc.eos_token_ids + eos)))
        mc.validate()  # its ids inside the vocabulary
    return mc


def build_model(mc: ModelConfig, dtype, device, tp) -> CausalLM:
    """The (unloaded) target model of ``mc``'s family for one rank's shard."""
    return family_of(mc.model_type).model(mc, dtype, device, tp=tp)


def build_mtp(mc: ModelConfig, target: CausalLM, dtype, device) -> MTPHead | NemotronMTPHead:
    family = family_of(mc.model_type)
    if family.mtp is None:
        raise ValueError(f"{family.name} models have no MTP head: use speculative='ngram' instead")
    if mc.num_nextn_predict_layers < 1:
        raise ValueError("speculative='mtp' needs the checkpoint's multi-token-prediction head, and its config says it "
                         "has none (num_nextn_predict_layers=0): use speculative='ngram' instead")
    return family.mtp(mc, target, dtype, device)
