"""Nemotron-H's multi-token-prediction head (Nemotron 3 Super's ``mtp.layers.*``), used as the MTP drafter's model.

The checkpoint lists the head's blocks flat, ``mtp.layers.{j}``, in the order of ``mtp_layers_block_type`` (``*E``
in Super: an attention block, then a MoE block). Each is one of the target's pre-norm residual blocks
(``models.nemotron_h.Block``, its norm ``mtp.layers.{j}.norm``); the first also holds the input fusion (``enorm``,
``hnorm``, ``eh_proj``), the last the output norm (``final_layernorm``). One draft step:

    x = eh_proj(concat(enorm(embed(token)), hnorm(hidden)))
    x = block_j(x) for each block in order
    out = final_layernorm(x)   -> the shared lm_head, and the ``hidden`` of the next chained step

``hidden`` is the target's final (normed) hidden state at the position before ``token``. The embeddings and the LM
head are the target's. The attention blocks keep their own KV (one extra KV layer each, numbered after the target's
layers), without positional encoding as the target's. One set of blocks serves every draft step (vLLM and SGLang
assert one MTP layer for this family; a checkpoint with ``num_nextn_predict_layers`` > 1 is refused by name).
transformers drops ``mtp.*`` on load, so there is no reference implementation there: the tests build the head's
function from transformers' own block classes (tests/test_nemotron_mtp.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..core import ForwardBatch
from ..layers.weights import CheckpointError, TensorReader, copy_into
from ..ops.norm import rms_norm_plain
from .nemotron_h import Block

PREFIX = "mtp.layers"


class NemotronMTPHead(nn.Module):
    def __init__(self, mc: ModelConfig, target, dtype: torch.dtype, device=None):
        super().__init__()
        if mc.num_nextn_predict_layers == 0:
            raise CheckpointError("speculative='mtp' needs the checkpoint's multi-token-prediction layers, and this "
                                  "one has none (num_nextn_predict_layers=0): use speculative='ngram' instead")
        if mc.num_nextn_predict_layers != 1:
            raise CheckpointError(f"this Nemotron-H checkpoint has num_nextn_predict_layers="
                                  f"{mc.num_nextn_predict_layers}; hylo's MTP drafter reads one set of MTP blocks "
                                  f"(as released): use speculative='ngram' instead")
        unknown = sorted(set(mc.mtp_layer_types) - {"full_attention", "moe", "mlp"})
        if unknown or not mc.mtp_layer_types:
            raise CheckpointError(f"Nemotron-H MTP blocks {list(mc.mtp_layer_types)} are not supported (attention, "
                                  f"MoE and MLP blocks are): use speculative='ngram' instead")
        H = mc.hidden_size
        self.config, self.eps = mc, mc.rms_norm_eps
        self.target = [target]  # shared embeddings and lm_head; a list so it is not registered as a submodule
        kw = dict(dtype=dtype, device=device)
        self.enorm = nn.Parameter(torch.empty(H, **kw), requires_grad=False)
        self.hnorm = nn.Parameter(torch.empty(H, **kw), requires_grad=False)
        self.eh_proj = nn.Parameter(torch.empty(H, 2 * H, **kw), requires_grad=False)
        self.final_norm = nn.Parameter(torch.empty(H, **kw), requires_grad=False)
        # attention blocks take the layer ids after the target's, which the hybrid backend maps to extra KV layers
        blocks, n_attn = [], 0
        for kind in mc.mtp_layer_types:
            layer_id = mc.num_hidden_layers + n_attn
            n_attn += kind == "full_attention"
            blocks.append(Block(mc, layer_id, dtype, device, kind=kind))
        self.blocks = nn.ModuleList(blocks)
        self.num_kv_layers = n_attn

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, backend) -> torch.Tensor:
        """input_ids: [T]; hidden: [T, H] (the target's, or the previous step's output). Returns [T, H] (normed)."""
        e = rms_norm_plain(self.target[0].embed_tokens(input_ids), self.enorm, self.eps)
        x = F.linear(torch.cat([e, rms_norm_plain(hidden, self.hnorm, self.eps)], dim=-1), self.eh_proj)
        for block in self.blocks:
            x = block(x, batch, backend)
        return rms_norm_plain(x, self.final_norm, self.eps)

    def write_kv(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, backend) -> None:
        """The head's KV at ``batch``'s positions (a plain decode step's bookkeeping): the whole head runs, since its
        later attention blocks' keys depend on the earlier blocks' outputs."""
        self.forward(input_ids, hidden, batch, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(hidden)

    def load(self, r: TensorReader) -> None:
        H, last = self.config.hidden_size, len(self.blocks) - 1
        if not r.has(f"{PREFIX}.0.eh_proj.weight"):
            raise CheckpointError("speculative='mtp' needs the checkpoint's multi-token-prediction layers "
                                  "(mtp.layers.*), and this checkpoint has none: use speculative='ngram' instead")
        copy_into(self.enorm, r.get(f"{PREFIX}.0.enorm.weight", (H,)))
        copy_into(self.hnorm, r.get(f"{PREFIX}.0.hnorm.weight", (H,)))
        copy_into(self.eh_proj, r.get(f"{PREFIX}.0.eh_proj.weight", (H, 2 * H)))
        copy_into(self.final_norm, r.get(f"{PREFIX}.{last}.final_layernorm.weight", (H,)))
        for j, block in enumerate(self.blocks):
            block.load(r, f"{PREFIX}.{j}")
