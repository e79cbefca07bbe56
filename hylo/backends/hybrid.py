"""Routes each layer to the attention or the linear-attention backend and fans the metadata hooks out to both."""

from __future__ import annotations

from ..core import ForwardBatch, ForwardMode
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
        # global layer id -> index inside that kind's cache (KV pool layers, state pool layers)
        self.local_index: dict[int, int] = {}
        counts = {"full_attention": 0, "linear_attention": 0}  # other kinds (MLP blocks) hold no cache
        for i, t in enumerate(layer_types):
            if t in counts:
                self.local_index[i] = counts[t]
                counts[t] += 1
        for i in range(extra_attn_layers):
            self.local_index[len(layer_types) + i] = counts["full_attention"] + i
        self.needs_cpu_seq_lens = any(c.needs_cpu_seq_lens for c in self.children)

    def attention(self, layer_id: int, *args, **kwargs):
        return self.attn.forward(self.local_index[layer_id], *args, **kwargs)

    def kv_store(self, layer_id: int, *args, **kwargs):
        return self.attn.kv_store(self.local_index[layer_id], *args, **kwargs)

    def linear_attention(self, layer_id: int, *args, **kwargs):
        return self.linear.forward(self.local_index[layer_id], *args, **kwargs)

    def commit_verified(self, state_slots, accepted) -> None:
        """After a verify: the accepted state of every row into its slot (the linear-attention layers' job)."""
        self.linear.commit_verified(state_slots, accepted)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        for c in self.children:
            c.init_forward_metadata(batch)

    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:
        for c in self.children:
            c.init_graph_state(max_bs, max_tokens)

    def init_forward_metadata_capture(self, bs: int, mode: ForwardMode) -> None:
        for c in self.children:
            c.init_forward_metadata_capture(bs, mode)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        for c in self.children:
            c.init_forward_metadata_replay(batch)
