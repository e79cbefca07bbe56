"""Routes each layer to the attention or the linear-attention backend and fans the metadata hooks out to both."""

from __future__ import annotations

from ..core import ForwardBatch
from .attention import AttentionBackend
from .base import Backend
from .gdn import GDNBackend
from .mamba2 import Mamba2Backend


class HybridBackend(Backend):
    def __init__(self, attn: AttentionBackend, linear: "GDNBackend | Mamba2Backend", layer_types: tuple[str, ...],
                 extra_attn_layers: int = 0):
        """``extra_attn_layers``: attention layers numbered after the model's (the MTP head's), each with its own KV
        layer after the model's attention layers."""
        self.attn = attn
        self.linear = linear
        self.children = (attn, linear)
        # global layer id -> index inside each kind's cache (KV pool layers, state pool layers); a "hybrid" layer
        # (Falcon-H1) has one of each, an MLP block none
        self.attn_index: dict[int, int] = {}
        self.linear_index: dict[int, int] = {}
        for i, t in enumerate(layer_types):
            if t in ("full_attention", "hybrid"):
                self.attn_index[i] = len(self.attn_index)
            if t in ("linear_attention", "hybrid"):
                self.linear_index[i] = len(self.linear_index)
        model_attn = len(self.attn_index)
        for i in range(extra_attn_layers):
            self.attn_index[len(layer_types) + i] = model_attn + i

    def attention(self, layer_id: int, *args, **kwargs):
        return self.attn.forward(self.attn_index[layer_id], *args, **kwargs)

    def kv_store(self, layer_id: int, *args, **kwargs):
        return self.attn.kv_store(self.attn_index[layer_id], *args, **kwargs)

    def store_kv(self, layer_id: int, *args, **kwargs):
        return self.attn.store_kv(self.attn_index[layer_id], *args, **kwargs)

    def linear_attention(self, layer_id: int, *args, **kwargs):
        return self.linear.forward(self.linear_index[layer_id], *args, **kwargs)

    def commit_verified(self, state_slots, accepted) -> None:
        """After a verify: the accepted state of every row into its slot (the linear-attention layers' job)."""
        self.linear.commit_verified(state_slots, accepted)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        for c in self.children:
            c.init_forward_metadata(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        for c in self.children:
            c.init_forward_metadata_replay(batch)
