"""The floors ``hylo bench`` divides by: the device's measured copy and matmul rates, and the bytes / FLOPs each
step of the benchmark model must move (``Footprint``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.hybrid import HybridForCausalLM


# ---- the hardware's two numbers ---------------------------------------------------------------------------------
def measure_copy_rate(device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    a = torch.empty(2 * 1024 ** 3 // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = _time_cuda(lambda: b.copy_(a), iters=20)
    return 2 * a.numel() * a.element_size() / (ms / 1e3)


def measure_matmul_rate(device) -> float:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    ms = _time_cuda(lambda: a @ b, iters=10)
    return 2 * n ** 3 / (ms / 1e3)


def _time_cuda(fn, iters: int) -> float:
    """Mean milliseconds per call, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


# ---- what a step must read ---------------------------------------------------------------------------------------
@dataclass
class Footprint:
    """Bytes of the model's parts as stored (bfloat16, or block-FP8 projections with their scales), for the floors."""

    non_expert: int  # every weight read at any batch size, except experts, lm_head, embedding
    expert: int  # one routed expert (gate, up, down)
    lm_head: int
    embed_row: int
    mtp_non_expert: int
    kv_per_token: int  # all the target's attention layers, K and V
    kv_per_token_layer: int  # one attention layer (the MTP head has one)
    state_per_req: int  # GDN conv + recurrent states of one request
    gdn_inputs_per_token: int  # a verify token's kept GDN inputs, all layers (conv output, raw a and b)
    num_experts: int
    top_k: int
    moe_layers: int
    matmul_params: int  # parameters multiplied per token in the target (experts: top-k of them), lm_head excluded

    @classmethod
    def of(cls, model: HybridForCausalLM, mtp, caches) -> "Footprint":
        """From the model's own parameters: their stored bytes (block-FP8 projections: a byte a weight plus their
        float32 block scales; everything else bfloat16)."""
        mc = model.config
        esz = 2
        blocks = _moe_blocks(model)
        moe_layers = len(blocks)
        expert, expert_params = _expert_size(blocks[0]) if moe_layers else (0, 0)
        total = _bytes(model)  # a tied embedding counted once
        embed = mc.vocab_size * mc.hidden_size * esz
        experts_all = moe_layers * mc.num_experts * expert
        non_expert = total - experts_all - (1 if mc.tie_word_embeddings else 2) * embed
        mtp_ne = 0
        if mtp is not None:
            mtp_ne = _bytes(mtp) - mc.num_experts * expert
        sp = caches.state_pool
        state = (sp.conv[:, 0].numel() * sp.conv.element_size() + sp.recurrent[:, 0].numel()
                 * sp.recurrent.element_size())
        kv = caches.kv_pool
        n_attn = len(mc.attn_layer_ids)
        kv_tok = 2 * n_attn * kv.k.shape[2] * kv.k.shape[3] * kv.k.element_size()
        weights = sum(p.numel() for n, p in model.named_parameters() if not n.endswith(".scale"))
        embeds = (1 if mc.tie_word_embeddings else 2) * mc.vocab_size * mc.hidden_size
        matmul = (weights - embeds - moe_layers * mc.num_experts * expert_params
                  + moe_layers * mc.num_experts_per_tok * expert_params)
        inputs = len(mc.linear_layer_ids) * (mc.conv_dim + 2 * mc.linear_num_value_heads) * esz
        return cls(non_expert, expert, embed, mc.hidden_size * esz, mtp_ne, kv_tok, kv_tok // n_attn, state,
                   inputs, mc.num_experts, mc.num_experts_per_tok, moe_layers, matmul)

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per layer for ``tokens`` tokens with uniform random routing."""
        if not self.num_experts:  # a dense model
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)

    def decode_bytes(self, bs: int, ctx: int) -> float:
        weights = self.non_expert + self.lm_head + bs * self.embed_row
        weights += self.moe_layers * self.experts_touched(bs) * self.expert
        return weights + bs * ctx * self.kv_per_token + 2 * bs * self.state_per_req

    def spec_step_bytes(self, bs: int, ctx: int, k: int, replay: bool = False) -> float:
        """One speculative step: verify (k + 1 tokens per request) and the commit of the accepted GDN state, the
        MTP head's extend over the k + 1 positions and its k - 1 chained steps (each re-reads the lm_head). The
        state: with checkpoints, the verify reads each slot and writes k + 1 states, the commit copies one; with
        ``replay``, the verify reads each slot and keeps its inputs, the commit reads and writes each slot once.
        Without an MTP head (n-gram drafts) the verify and the commit alone."""
        t = bs * (k + 1)
        verify = self.non_expert + self.lm_head + t * self.embed_row
        verify += self.moe_layers * self.experts_touched(t) * self.expert
        verify += bs * (ctx + k + 1) * self.kv_per_token
        if replay:  # read the slot, then the commit's read and write; the kept inputs written and read back
            verify += bs * self.state_per_req * 3 + 2 * t * self.gdn_inputs_per_token
        else:  # read the slot, write k + 1 checkpoints, the commit's copy
            verify += bs * self.state_per_req * (1 + (k + 1) + 2)
        if not self.mtp_non_expert:  # n-gram drafts: made from the token history, no weights read
            return verify
        # the head has one MoE layer: its extend pass touches the experts of t tokens, each chained step those of bs
        drafts = k * (self.mtp_non_expert + self.lm_head) + self.experts_touched(t) * self.expert
        drafts += (k - 1) * self.experts_touched(bs) * self.expert + k * bs * ctx * self.kv_per_token_layer
        return verify + drafts


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _expert_weights(module: torch.nn.Module):
    """The routed experts' two stacked weights of a MoE block ([E, 2I or I, H], [E, H, I]), or None: SwiGLU
    experts (``layers.moe.SparseMoE``) or Nemotron 3's non-gated ones (``layers.mlp.GroupedSigmoidMoE``)."""
    from ..layers.mlp import GroupedSigmoidMoE
    from ..layers.moe import SparseMoE

    if isinstance(module, SparseMoE):
        return module.w13, module.w2
    if isinstance(module, GroupedSigmoidMoE):
        return module.up, module.down
    return None


def _moe_blocks(model: torch.nn.Module) -> list:
    """The expert weight pairs of every MoE block of the model (not counting an MTP head's: it is a separate
    module)."""
    return [w for w in map(_expert_weights, model.modules()) if w is not None]


def _expert_size(weights) -> tuple[int, int]:
    """(bytes, parameters) of one routed expert (gate, up, down; or up, down), as the model stores them."""
    size, params = 0, 0
    for w in weights:
        for p in ([w] if isinstance(w, torch.Tensor) else [w.q, w.scale]):
            size += p[0].numel() * p.element_size()
        params += w.shape[1] * w.shape[2]
    return size, params
