"""Seeded random weights under the checkpoint's own names (per-expert keys, ``mtp.*`` included).

Used for the embedded default model, for benchmark models, and by tests to append ``mtp.*`` tensors to checkpoints
that transformers wrote (transformers does not write the MTP head).
"""

from __future__ import annotations

import math
import zlib

import torch

from ..config import ModelConfig
from ..layers.weights import CheckpointError, TensorReader
from ..ops.fp8 import dequantize_fp8_block, expand_scales, quantize_fp8_block
from .quant import fp8_quantizable


def _decoder_layer(mc: ModelConfig, prefix: str, kind: str, moe: bool, g: torch.Generator, std: float,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    H = mc.hidden_size
    t: dict[str, torch.Tensor] = {}

    def normal(name, *shape):
        t[name] = (torch.randn(*shape, generator=g) * std).to(dtype)

    def zeros(name, *shape):  # zero-centred norms: weight 0 means scale 1; small noise keeps them non-trivial
        t[name] = (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    zeros(f"{prefix}.input_layernorm.weight", H)
    zeros(f"{prefix}.post_attention_layernorm.weight", H)
    if kind == "linear_attention":
        p = f"{prefix}.linear_attn"
        hv = mc.linear_num_value_heads
        normal(f"{p}.in_proj_qkvz.weight", 2 * mc.linear_key_dim + 2 * mc.linear_value_dim, H)
        normal(f"{p}.in_proj_ba.weight", 2 * hv, H)
        bound = 1.0 / math.sqrt(mc.linear_conv_kernel_dim)
        t[f"{p}.conv1d.weight"] = ((torch.rand(mc.conv_dim, 1, mc.linear_conv_kernel_dim, generator=g) * 2 - 1)
                                   * bound).to(dtype)
        t[f"{p}.A_log"] = (torch.rand(hv, generator=g) * (16 - 0.01) + 0.01).log().to(dtype)
        t[f"{p}.dt_bias"] = torch.ones(hv, dtype=dtype)
        t[f"{p}.norm.weight"] = (1 + torch.randn(mc.linear_value_head_dim, generator=g) * 0.1).to(dtype)
        normal(f"{p}.out_proj.weight", H, mc.linear_value_dim)
    else:
        p = f"{prefix}.self_attn"
        q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
        normal(f"{p}.q_proj.weight", 2 * q, H)
        normal(f"{p}.k_proj.weight", kv, H)
        normal(f"{p}.v_proj.weight", kv, H)
        normal(f"{p}.o_proj.weight", H, q)
        if mc.attention_bias:
            for name, n in (("q_proj", 2 * q), ("k_proj", kv), ("v_proj", kv), ("o_proj", H)):
                normal(f"{p}.{name}.bias", n)
        zeros(f"{p}.q_norm.weight", mc.head_dim)
        zeros(f"{p}.k_norm.weight", mc.head_dim)
    p = f"{prefix}.mlp"
    if moe:
        normal(f"{p}.gate.weight", mc.num_experts, H)
        for e in range(mc.num_experts):
            normal(f"{p}.experts.{e}.gate_proj.weight", mc.moe_intermediate_size, H)
            normal(f"{p}.experts.{e}.up_proj.weight", mc.moe_intermediate_size, H)
            normal(f"{p}.experts.{e}.down_proj.weight", H, mc.moe_intermediate_size)
        if mc.shared_expert_intermediate_size > 0:
            normal(f"{p}.shared_expert.gate_proj.weight", mc.shared_expert_intermediate_size, H)
            normal(f"{p}.shared_expert.up_proj.weight", mc.shared_expert_intermediate_size, H)
            normal(f"{p}.shared_expert.down_proj.weight", H, mc.shared_expert_intermediate_size)
            normal(f"{p}.shared_expert_gate.weight", 1, H)
    else:
        normal(f"{p}.gate_proj.weight", mc.intermediate_size, H)
        normal(f"{p}.up_proj.weight", mc.intermediate_size, H)
        normal(f"{p}.down_proj.weight", H, mc.intermediate_size)
    return t


def random_mtp_tensors(mc: ModelConfig, seed: int, std: float = 0.02,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors of a Qwen3-Next checkpoint (one extra full-attention decoder layer per MTP layer)."""
    g = torch.Generator().manual_seed(seed + 7919)
    H = mc.hidden_size
    t = {
        "mtp.fc.weight": (torch.randn(H, 2 * H, generator=g) * std).to(dtype),
        "mtp.pre_fc_norm_embedding.weight": (torch.randn(H, generator=g) * 0.1).to(dtype),
        "mtp.pre_fc_norm_hidden.weight": (torch.randn(H, generator=g) * 0.1).to(dtype),
        "mtp.norm.weight": (torch.randn(H, generator=g) * 0.1).to(dtype),
    }
    for i in range(mc.num_nextn_predict_layers):
        t.update(_decoder_layer(mc, f"mtp.layers.{i}", "full_attention", mc.num_experts > 0, g, std, dtype))
    return t


def random_checkpoint(mc: ModelConfig, seed: int = 0, std: float = 0.02, with_mtp: bool = True,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A full random checkpoint, as tensors named like a Hugging Face Qwen3-Next checkpoint on disk."""
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": (torch.randn(mc.vocab_size, mc.hidden_size, generator=g) * std).to(dtype)}
    if not mc.tie_word_embeddings:
        t["lm_head.weight"] = (torch.randn(mc.vocab_size, mc.hidden_size, generator=g) * std).to(dtype)
    for i, kind in enumerate(mc.layer_types):
        t.update(_decoder_layer(mc, f"model.layers.{i}", kind, mc.is_moe_layer(i), g, std, dtype))
    t["model.norm.weight"] = (torch.randn(mc.hidden_size, generator=g) * 0.1).to(dtype)
    if with_mtp:
        t.update(random_mtp_tensors(mc, seed, std, dtype))
    return t


class RandomReader(TensorReader):
    """Random weights generated on demand, on ``device``, for whatever tensor a layer asks for by name and shape.

    Builds benchmark models directly on the GPU without a checkpoint; the rules follow ``random_checkpoint``. Each
    tensor's values depend only on (seed, name), so two readers with the same seed build the same model.
    ``plain_norms``: the model's norms multiply by their weight (the Mamba2 families'), so their weights are drawn
    near 1; else near 0 (the Qwen families' zero-centred norms, all but GDN's output norm).
    """

    def __init__(self, seed: int, device: torch.device, std: float = 0.02, with_mtp: bool = True,
                 plain_norms: bool = False):
        super().__init__()
        self.seed, self.device, self.std, self.with_mtp = seed, torch.device(device), std, with_mtp
        self.plain_norms = plain_norms

    def keys(self):
        return self.used

    def has(self, name: str) -> bool:
        # experts one by one, as random_checkpoint names them (the fused names would draw other values)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return False
        return self.with_mtp or not name.startswith("mtp.")

    def _load(self, name: str):
        raise NotImplementedError("RandomReader needs the shape: use get(name, shape)")

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if shape is None or not self.has(name):
            return super().get(name, shape)
        self.used.add(name)
        g = torch.Generator(device=self.device).manual_seed((self.seed * 1000003 + zlib.crc32(name.encode())) % 2**63)
        kw = dict(generator=g, device=self.device, dtype=torch.float32)
        if name.endswith("linear_attn.norm.weight") or ("norm" in name and self.plain_norms):  # plain weights
            return 1 + torch.randn(shape, **kw) * 0.1
        if "norm" in name:  # zero-centred norms
            return torch.randn(shape, **kw) * 0.1
        if name.endswith("A_log"):
            return (torch.rand(shape, **kw) * 15 + 1).log()
        if name.endswith("dt_bias"):
            return torch.ones(shape, device=self.device)
        if name.endswith("conv1d.weight"):
            return (torch.rand(shape, **kw) * 2 - 1) / math.sqrt(shape[-1])
        return torch.randn(shape, **kw) * self.std


class RandomFp8Reader(RandomReader):
    """``RandomReader``'s weights with the projections an FP8 release quantizes (``quant.fp8_quantizable``) rounded
    to block FP8: each such weight comes back dequantized, and its scales through ``scale_maps``, so that a model
    built with FP8 weights in memory (the FP8 benchmark shapes) holds exactly these FP8 values."""

    def __init__(self, seed: int, device: torch.device, block: tuple[int, int], std: float = 0.02,
                 with_mtp: bool = True, plain_norms: bool = False):
        super().__init__(seed, device, std, with_mtp, plain_norms)
        self.block = tuple(block)

    def fp8(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_block(super().get(name, shape), self.block)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if shape is None or not self.has(name) or not fp8_quantizable(name, len(shape)):
            return super().get(name, shape)
        return dequantize_fp8_block(*self.fp8(name, shape), self.block)

    def scale_maps(self) -> TensorReader:
        return _RandomScaleMaps(self)


class _RandomScaleMaps(TensorReader):
    """Each element's FP8 scale of a ``RandomFp8Reader``'s weights (0 where unquantized)."""

    def __init__(self, weights: RandomFp8Reader):
        super().__init__()
        self.weights = weights

    def keys(self):
        return self.weights.keys()

    def has(self, name: str) -> bool:
        return self.weights.has(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if shape is None or not self.has(name):
            raise CheckpointError(f"no scales for {name!r} without its shape")
        if not fp8_quantizable(name, len(shape)):
            return torch.zeros(shape, device=self.weights.device)
        _, scale = self.weights.fp8(name, shape)
        return expand_scales(scale, shape, self.weights.block)
