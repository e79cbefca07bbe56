"""The causal LM every family's model is: what the engine drives, and the parts all families share, the token
embedding and the LM head (the same tensor under ``tie_word_embeddings``; ``registry.untie_where_the_head_differs``
decides that flag as transformers does). A family's model builds its layers and final norm, and says where its
embedding is in a checkpoint (``embed_name``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..core import ForwardBatch
from ..layers.weights import TensorReader, copy_into
from ..parallel.group import SINGLE, TPGroup


class CausalLM(nn.Module):
    family = "causal LM"  # the family's name, in messages

    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device=None, tp: TPGroup = SINGLE):
        """``mc``: the config of this rank's shard (``parallel.sharding.local_config``); ``tp``: its group."""
        super().__init__()
        self.config, self.dtype, self.tp = mc, dtype, tp
        shape, kw = (mc.vocab_size, mc.hidden_size), dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.empty(shape, **kw), requires_grad=False)
        self.lm_head = (self.embed if mc.tie_word_embeddings
                        else nn.Parameter(torch.empty(shape, **kw), requires_grad=False))

    def forward(self, batch: ForwardBatch, backend) -> torch.Tensor:
        """The final hidden states (after the final norm), [T, hidden]."""
        raise NotImplementedError

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the activations' dtype: the greedy argmax reads them as they are (a cast to float32 is exact,
        so it would pick the same tokens: at batch 256 the cast alone moved 233 MB per step), and sampling casts
        them itself."""
        return F.linear(hidden, self.lm_head)

    @classmethod
    def embed_name(cls, r: TensorReader) -> str:
        """The embedding's name in the checkpoint ``r``."""
        raise NotImplementedError

    def load(self, r: TensorReader, progress: bool = False) -> None:
        raise NotImplementedError

    def load_embeddings(self, r: TensorReader) -> None:
        """The embedding, and the LM head unless it is the embedding."""
        shape = (self.config.vocab_size, self.config.hidden_size)
        copy_into(self.embed, r.get(self.embed_name(r), shape))
        if not self.config.tie_word_embeddings:
            copy_into(self.lm_head, r.get("lm_head.weight", shape))
