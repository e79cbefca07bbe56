"""What the Mamba2 families (Nemotron-H, Granite-4.0-H, Falcon-H1) share: their ModelConfig's neutral fields, and
the causal LM around a stack of a family's layers: the token embedding (times the muP embedding multiplier, where
the family has one), the layers, a final plain RMSNorm, the LM head (logits divided by the muP logits multiplier).
A family file subclasses it with its layer class and checkpoint names."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Mamba2Spec, ModelConfig
from ..core import ForwardBatch
from ..layers.weights import TensorReader, copy_into
from ..ops.norm import rms_norm_plain
from ..parallel.group import SINGLE, TPGroup
from ..progress import progress as progress_of
from .causal_lm import CausalLM


def json_float(v: Any) -> float:
    """A config number; transformers writes infinity as ``{"__float__": "Infinity"}``."""
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


def mamba2_model_config(mamba: Mamba2Spec, **fields) -> ModelConfig:
    """A Mamba2 family's ModelConfig: ``fields`` over neutral values for what does not apply to it (the GDN shape:
    the state pool takes its shapes from ``mamba``; experts, where ``fields`` has none; an MTP head)."""
    neutral = dict(linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=1, linear_value_head_dim=1,
                   linear_conv_kernel_dim=mamba.conv_kernel, num_experts=0, num_experts_per_tok=0,
                   moe_intermediate_size=0, shared_expert_intermediate_size=0, norm_topk_prob=False,
                   decoder_sparse_step=1, mlp_only_layers=(), num_nextn_predict_layers=0)
    return ModelConfig(**{**neutral, **fields, "mamba": mamba})


class LayerStack(CausalLM):
    EMBED, LAYERS, FINAL_NORM = "model.embed_tokens.weight", "model.layers", "model.norm.weight"
    NORM_WEIGHT_IN_FLOAT32 = False  # the final norm's weight applied in float32 (Nemotron-H) or in x's dtype

    def make_layer(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device) -> nn.Module:
        """One layer: a module with ``forward(h, batch, backend) -> h`` and ``load(reader, prefix)``."""
        raise NotImplementedError

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device=None, tp: TPGroup = SINGLE):
        super().__init__(mc, dtype, device, tp)  # (tensor parallelism is refused before: sharding.check_divisible)
        self.layers = nn.ModuleList(self.make_layer(mc, i, dtype, device) for i in range(mc.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(mc.hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        """Returns the final hidden states (after the final norm), [T, hidden]."""
        h = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            h = layer(h, batch, backend)
        return rms_norm_plain(h, self.norm, self.config.rms_norm_eps, self.NORM_WEIGHT_IN_FLOAT32)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        e = super().embed_tokens(ids)
        return e if self.config.mup is None else e * self.config.mup.embedding

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits if self.config.mup is None else logits / self.config.mup.logits

    @classmethod
    def embed_name(cls, r: TensorReader) -> str:
        return cls.EMBED

    def load(self, r: TensorReader, progress: bool = False) -> None:
        self.load_embeddings(r)
        for i, layer in enumerate(progress_of(self.layers, "loading layers", enabled=progress, unit="layers")):
            layer.load(r, f"{self.LAYERS}.{i}")
        copy_into(self.norm, r.get(self.FINAL_NORM, (self.config.hidden_size,)))
