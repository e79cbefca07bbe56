"""The causal LM around a stack of a family's layers, shared by the Mamba2 families (Nemotron-H, Granite-4.0-H,
Falcon-H1): the token embedding (times the muP embedding multiplier, where the family has one), the layers, a final
plain RMSNorm, the LM head (logits divided by the muP logits multiplier). A family file subclasses it with its layer
class and checkpoint names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..core import ForwardBatch
from ..layers.weights import TensorReader, copy_into
from ..ops.norm import rms_norm_plain
from ..parallel.group import SINGLE, TPGroup
from ..progress import progress as progress_of


class LayerStack(nn.Module):
    family = "layer stack"  # the family's name, in messages
    EMBED, LAYERS, FINAL_NORM = "model.embed_tokens.weight", "model.layers", "model.norm.weight"
    NORM_WEIGHT_IN_FLOAT32 = False  # the final norm's weight applied in float32 (Nemotron-H) or in x's dtype

    def make_layer(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device) -> nn.Module:
        """One layer: a module with ``forward(h, batch, backend) -> h`` and ``load(reader, prefix)``."""
        raise NotImplementedError

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device=None, tp: TPGroup = SINGLE):
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{self.family} models do not run with tensor parallelism yet: use tensor_parallel_size=1")
        self.config, self.dtype, self.tp = mc, dtype, tp
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.empty(mc.vocab_size, mc.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(self.make_layer(mc, i, dtype, device) for i in range(mc.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(mc.hidden_size, **kw), requires_grad=False)
        self.lm_head = (self.embed if mc.tie_word_embeddings
                        else nn.Parameter(torch.empty(mc.vocab_size, mc.hidden_size, **kw), requires_grad=False))

    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        """Returns the final hidden states (after the final norm), [T, hidden]."""
        h = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            h = layer(h, batch, backend)
        return rms_norm_plain(h, self.norm, self.config.rms_norm_eps, self.NORM_WEIGHT_IN_FLOAT32)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        e = F.embedding(ids, self.embed)
        return e if self.config.mup is None else e * self.config.mup.embedding

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head)
        return logits if self.config.mup is None else logits / self.config.mup.logits

    def load(self, r: TensorReader, progress: bool = False) -> None:
        mc = self.config
        shape = (mc.vocab_size, mc.hidden_size)
        copy_into(self.embed, r.get(self.EMBED, shape))
        if not mc.tie_word_embeddings:
            copy_into(self.lm_head, r.get("lm_head.weight", shape))
        for i, layer in enumerate(progress_of(self.layers, "loading layers", enabled=progress, unit="layers")):
            layer.load(r, f"{self.LAYERS}.{i}")
        copy_into(self.norm, r.get(self.FINAL_NORM, (mc.hidden_size,)))
