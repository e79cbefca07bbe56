"""The hybrid decoder every GDN family shares: a stack of layers, each a token mixer (Gated DeltaNet or gated full
attention, by ``layer_types``) followed by an MLP (sparse MoE or dense SwiGLU), between a token embedding and an LM
head. A family (``qwen3_next.py``, ``qwen3_5.py``) subclasses ``HybridForCausalLM`` with what differs in its
checkpoint: where the text model's tensors live and how the GDN input projection is laid out on disk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.gdn import GDNShape
from ..config import ModelConfig
from ..core import ForwardBatch
from ..layers.attention import GatedAttention
from ..layers.linear_attn import GatedDeltaNet
from ..layers.moe import MLP, SparseMoE
from ..layers.norm import RMSNorm
from ..layers.weights import TensorReader, copy_into, fp8_block_of
from ..ops.norm import add_rms_norm
from ..parallel.group import SINGLE, TPGroup
from ..progress import progress as progress_of
from .causal_lm import CausalLM

# (reader, tensor prefix of the layer's mixer, its shape, hidden size) -> the fused [q | k | v | z | b | a] rows
InProjReader = Callable[[TensorReader, str, GDNShape, int], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device=None, attention_only=False,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp  # with tensor parallelism the mixer and the MLP each end in a partial sum per rank
        # attention_only: the MTP head's layer, a full-attention layer numbered past the target's layers
        self.is_linear = not attention_only and mc.layer_types[layer_id] == "linear_attention"
        self.input_norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype, device)
        self.post_norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype, device)
        self.mixer = (GatedDeltaNet(mc, layer_id, dtype, device) if self.is_linear
                      else GatedAttention(mc, layer_id, dtype, device))
        use_moe = mc.num_experts > 0 if attention_only else mc.is_moe_layer(layer_id)
        self.mlp = (SparseMoE(mc, dtype, device) if use_moe
                    else MLP(mc.hidden_size, mc.intermediate_size, dtype, device, fp8_block_of(mc)))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, backend):
        """h: the previous layer's output (or the embeddings, with residual None). Returns (output, residual):
        the residual stream is added lazily, fused with the next norm."""
        if residual is None:
            residual, h = h, self.input_norm(h)
        else:
            residual, h = add_rms_norm(residual, h, self.input_norm.weight, self.input_norm.eps)
        # On one rank the mixer's output projection and the MLP may hand back unreduced rows [T, J, hidden] (split-K
        # partials, expert pairs); the add_rms_norm that follows sums them. Across ranks they are reduced first.
        reduce = self.tp.size > 1
        h = self.tp.all_reduce(self.mixer(h, batch, backend, reduce=reduce))
        residual, h = add_rms_norm(residual, h, self.post_norm.weight, self.post_norm.eps)
        return self.tp.all_reduce(self.mlp(h, reduce=reduce)), residual

    def load(self, r: TensorReader, prefix: str, read_in_proj: InProjReader) -> None:
        copy_into(self.input_norm.weight, r.get(f"{prefix}.input_layernorm.weight", self.input_norm.weight.shape))
        copy_into(self.post_norm.weight,
                  r.get(f"{prefix}.post_attention_layernorm.weight", self.post_norm.weight.shape))
        if self.is_linear:
            self.mixer.load(r, f"{prefix}.linear_attn", read_in_proj)
        else:
            self.mixer.load(r, f"{prefix}.self_attn")
        self.mlp.load(r, f"{prefix}.mlp")


class HybridForCausalLM(CausalLM):
    """The Qwen families' model: GDN or gated attention per layer, each followed by a MoE or an MLP. Subclasses set
    ``family`` and implement ``read_in_proj`` (and ``text_prefix`` where the text model's tensors are not under
    ``model.``)."""

    family = "hybrid"

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device=None, tp: TPGroup = SINGLE):
        super().__init__(mc, dtype, device, tp)
        self.layers = nn.ModuleList(DecoderLayer(mc, i, dtype, device, tp=tp) for i in range(mc.num_hidden_layers))
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps, dtype, device)

    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        """Returns the final hidden states (after the final norm), [T, hidden]."""
        h, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, batch, backend)
        return add_rms_norm(residual, h, self.norm.weight, self.norm.eps)[1]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().embed_tokens(ids)
        # vocab-parallel: each rank looks up the ids in its slice, zeros elsewhere; the sum is the embedding
        rows = self.embed.shape[0]
        local = ids - self.tp.rank * rows
        mine = (local >= 0) & (local < rows)
        out = F.embedding(local.clamp(0, rows - 1), self.embed) * mine[:, None].to(self.embed.dtype)
        return self.tp.all_reduce(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(super().compute_logits(hidden))  # (each rank holds a slice of the vocabulary)

    # ---- loading -------------------------------------------------------------------------------------------------
    @staticmethod
    def read_in_proj(r: TensorReader, prefix: str, s: GDNShape, hidden: int) -> torch.Tensor:
        """The GDN input projection as hylo lays it out, [q | k | v | z | b | a] rows, from the checkpoint."""
        raise NotImplementedError

    @staticmethod
    def text_prefix(r: TensorReader) -> str:
        """Where the text model's tensors (``embed_tokens``, ``layers``, ``norm``) live in the checkpoint."""
        return "model"

    @classmethod
    def embed_name(cls, r: TensorReader) -> str:
        return f"{cls.text_prefix(r)}.embed_tokens.weight"

    def load(self, r: TensorReader, progress: bool = False) -> None:
        mc, p = self.config, self.text_prefix(r)
        self.load_embeddings(r)
        for i, layer in enumerate(progress_of(self.layers, "loading layers", enabled=progress, unit="layers")):
            layer.load(r, f"{p}.layers.{i}", self.read_in_proj)
        copy_into(self.norm.weight, r.get(f"{p}.norm.weight", (mc.hidden_size,)))
