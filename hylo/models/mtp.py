"""The multi-token-prediction head of Qwen3-Next and Qwen3.5 (``mtp.*`` in the checkpoint), used as the MTP
drafter's model.

One draft step: ``fc(concat(norm_e(embed(token)), norm_h(hidden)))``, a full-attention decoder layer (the target's
MLP kind: the MoE of a MoE model, the dense MLP of a dense one), ``mtp.norm``; the result feeds the shared
``lm_head`` and is the ``hidden`` of the next chained step.
``hidden`` is the target's final (normed) hidden state at the position before ``token``. The layer keeps its own
attention KV in the KV pool (one extra KV layer), at the same token locations as the target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..core import ForwardBatch
from ..layers.norm import RMSNorm
from ..layers.weights import CheckpointError, TensorReader, copy_into
from ..ops.linear import dense
from ..ops.norm import add_rms_norm
from .hybrid import DecoderLayer, HybridForCausalLM


def has_mtp_weights(reader: TensorReader) -> bool:
    return reader.has("mtp.fc.weight")


class MTPHead(nn.Module):
    def __init__(self, mc: ModelConfig, target: HybridForCausalLM, dtype: torch.dtype, device=None):
        super().__init__()
        H = mc.hidden_size
        self.config = mc
        self.target = [target]  # shared embed and lm_head; a list so it is not registered as a submodule
        self.fc = nn.Parameter(torch.empty(H, 2 * H, dtype=dtype, device=device), requires_grad=False)
        self.norm_embedding = RMSNorm(H, mc.rms_norm_eps, dtype, device)
        self.norm_hidden = RMSNorm(H, mc.rms_norm_eps, dtype, device)
        self.norm = RMSNorm(H, mc.rms_norm_eps, dtype, device)
        # layer ids continue after the target's, so the hybrid backend maps them to the extra KV layers
        self.layers = nn.ModuleList(
            DecoderLayer(mc, mc.num_hidden_layers + i, dtype, device, attention_only=True, tp=target.tp)
            for i in range(mc.num_nextn_predict_layers))

    @property
    def num_kv_layers(self) -> int:
        """The extra KV layers the head's attention takes (after the target's)."""
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, backend) -> torch.Tensor:
        """input_ids: [T]; hidden: [T, H] (target or previous MTP output). Returns the MTP hidden [T, H] (normed).

        NOTE: checkpoints with several MTP layers chain them within one step (layer i refines layer i-1's output);
        Qwen3-Next and Qwen3.5 ship one.
        """
        target = self.target[0]
        e = self.norm_embedding(target.embed_tokens(input_ids))
        h, residual = F.linear(torch.cat([e, self.norm_hidden(hidden)], dim=-1), self.fc), None
        for layer in self.layers:
            h, residual = layer(h, residual, batch, backend)
        return add_rms_norm(residual, h, self.norm.weight, self.norm.eps)[1]

    def write_kv(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, backend) -> None:
        """The head's attention keys and values at ``batch``'s positions, without the rest of the step: what a plain
        decode step needs to keep the head's KV complete (its attention, MLP and logits are not needed there). With
        several layers each one's keys depend on the previous layer's output: the whole head runs then."""
        if len(self.layers) != 1:
            self.forward(input_ids, hidden, batch, backend)
            return
        target = self.target[0]
        e = self.norm_embedding(target.embed_tokens(input_ids))
        h = dense(torch.cat([e, self.norm_hidden(hidden)], dim=-1), self.fc)  # the few-row GEMV at decode
        layer = self.layers[0]
        layer.mixer.write_kv(layer.input_norm(h), batch, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(hidden)

    def load(self, r: TensorReader) -> None:
        H = self.config.hidden_size
        if not has_mtp_weights(r):
            raise CheckpointError("speculative='mtp' needs the checkpoint's multi-token-prediction head (mtp.* "
                                  "tensors), and this checkpoint has none: use speculative='ngram' instead")
        if "mtp.embed_tokens.weight" in r.keys():  # listed by the checkpoint (generating readers answer has() to all)
            raise CheckpointError("this checkpoint's MTP head has its own embeddings (mtp.embed_tokens), which hylo "
                                  "does not support yet: use speculative='ngram' instead")
        copy_into(self.fc, r.get("mtp.fc.weight", (H, 2 * H)))
        copy_into(self.norm_embedding.weight, r.get("mtp.pre_fc_norm_embedding.weight", (H,)))
        copy_into(self.norm_hidden.weight, r.get("mtp.pre_fc_norm_hidden.weight", (H,)))
        copy_into(self.norm.weight, r.get("mtp.norm.weight", (H,)))
        for i, layer in enumerate(self.layers):
            layer.load(r, f"mtp.layers.{i}", self.target[0].read_in_proj)
