"""Falcon-H1 (``falcon_h1``): in every layer a Mamba2 mixer and RoPE attention side by side on the same normed input,
their outputs summed into the residual, then a SwiGLU MLP; muP multipliers everywhere. Names as released and as
transformers writes them: ``model.layers.N.{mamba, self_attn, feed_forward, input_layernorm, pre_ff_layernorm}``,
``model.final_layernorm``.

The multipliers that scale a projection's input or output (``ssm_in_multiplier``, ``ssm_multipliers`` per
segment of the Mamba2 input projection, ``ssm_out_multiplier``, ``attention_in_multiplier``, ``key_multiplier``,
``attention_out_multiplier``, ``mlp_multipliers``) are folded into those projections' weights at load, so the
layers run unscaled (in float32 the same numbers; in bfloat16 a rounding apart from scaling the activations); the
embedding and LM-head multipliers are applied as they come. Not yet served, refused before a weight is read: tensor
parallelism, MLP biases, RoPE scaling other than the default.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Mamba2Spec, ModelConfig, MuP
from ..core import ForwardBatch
from ..layers.attention import Attention
from ..layers.mamba2 import Mamba2Mixer
from ..layers.moe import MLP
from ..layers.weights import TensorReader, copy_into
from ..ops.norm import rms_norm_plain
from .hf_config import eos_ids, full_rope_of
from .stack import LayerStack, json_float, mamba2_model_config

MODEL_TYPES = ("falcon_h1",)


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    """A Falcon-H1 ``config.json`` as hylo's ModelConfig, its multipliers in ``ModelConfig.mup``."""
    name = "falcon_h1 config"
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{name}: mlp_bias=true is not supported")
    theta = full_rope_of(cfg, name)
    hidden = cfg.get("hidden_size", 4096)
    heads = cfg.get("mamba_n_heads", 128)
    inner = cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2) * hidden)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else head_dim
    if head_dim * heads != inner:
        raise ValueError(f"{name}: mamba_n_heads * mamba_d_head = {heads * head_dim} is not the Mamba2 inner size "
                         f"{inner} (mamba_d_ssm, or mamba_expand * hidden_size)")
    for key, count in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        if cfg.get(key) is not None and len(cfg[key]) != count:
            raise ValueError(f"{name}: {key} must hold {count} numbers")
    mamba = Mamba2Spec(num_heads=heads, head_dim=head_dim, n_groups=cfg.get("mamba_n_groups", 1),
                       state_size=cfg.get("mamba_d_state", 256), conv_kernel=cfg.get("mamba_d_conv", 4),
                       conv_bias=cfg.get("mamba_conv_bias", True), proj_bias=cfg.get("mamba_proj_bias", False),
                       norm_eps=cfg.get("rms_norm_eps", 1e-5),
                       dt_limit=tuple(json_float(v) for v in cfg.get("time_step_limit") or (0.0, float("inf"))),
                       chunk_size=cfg.get("mamba_chunk_size", 256),
                       norm=(("norm_then_gate" if cfg.get("mamba_norm_before_gate", True) else "gate_then_norm")
                             if cfg.get("mamba_rms_norm", False) else "gate"),
                       out_bias=cfg.get("projectors_bias", False))
    attn_heads = cfg.get("num_attention_heads", 32)
    layers = cfg.get("num_hidden_layers", 32)
    return mamba2_model_config(
        mamba, vocab_size=cfg.get("vocab_size", 128000), hidden_size=hidden, num_hidden_layers=layers,
        layer_types=("hybrid",) * layers, num_attention_heads=attn_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or attn_heads,
        head_dim=cfg.get("head_dim") or hidden // attn_heads,
        rope_theta=theta, partial_rotary_factor=1.0,
        attention_bias=bool(cfg.get("attention_bias", False)), intermediate_size=cfg.get("intermediate_size", 14336),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids(cfg.get("eos_token_id")), hidden_act="silu",
        model_type=cfg.get("model_type", "falcon_h1"),
        mup=MuP(embedding=float(cfg.get("embedding_multiplier", 1.0)),
                logits=1.0 / float(cfg.get("lm_head_multiplier", 1.0)),
                ssm_in=float(cfg.get("ssm_in_multiplier", 1.0)),
                ssm_segments=tuple(float(v) for v in cfg.get("ssm_multipliers") or (1.0,) * 5),
                ssm_out=float(cfg.get("ssm_out_multiplier", 1.0)),
                attention_in=float(cfg.get("attention_in_multiplier", 1.0)),
                key=float(cfg.get("key_multiplier", 1.0)),
                attention_out=float(cfg.get("attention_out_multiplier", 1.0)),
                mlp=tuple(float(v) for v in cfg.get("mlp_multipliers") or (1.0, 1.0))))


class FalconH1Layer(nn.Module):
    def __init__(self, mc: ModelConfig, layer_id: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = mc.rms_norm_eps
        kw = dict(dtype=dtype, device=device)
        self.input_norm = nn.Parameter(torch.empty(mc.hidden_size, **kw), requires_grad=False)
        self.pre_ff_norm = nn.Parameter(torch.empty(mc.hidden_size, **kw), requires_grad=False)
        self.mamba = Mamba2Mixer(mc.hidden_size, mc.mamba, layer_id, dtype, device)
        self.attn = Attention(mc, layer_id, dtype, device)
        self.mlp = MLP(mc.hidden_size, mc.intermediate_size, dtype, device)
        self.mup = mc.mup

    def _norm(self, h, w):
        return rms_norm_plain(h, w, self.eps, weight_in_float32=False)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, backend) -> torch.Tensor:
        x = self._norm(h, self.input_norm)
        h = h + (self.mamba(x, batch, backend) + self.attn(x, batch, backend))
        return h + self.mlp(self._norm(h, self.pre_ff_norm))

    @torch.no_grad()
    def load(self, r: TensorReader, prefix: str) -> None:
        copy_into(self.input_norm, r.get(f"{prefix}.input_layernorm.weight", tuple(self.input_norm.shape)))
        copy_into(self.pre_ff_norm, r.get(f"{prefix}.pre_ff_layernorm.weight", tuple(self.pre_ff_norm.shape)))
        self.mamba.load(r, f"{prefix}.mamba")
        self.attn.load(r, f"{prefix}.self_attn")
        self.mlp.load(r, f"{prefix}.feed_forward")
        self._fold()

    def _fold(self) -> None:
        """The multipliers into the projections (module docstring)."""
        m, a, mup = self.mamba, self.attn, self.mup
        s = m.cfg
        gn = s.n_groups * s.state_size
        seg = torch.tensor(mup.ssm_segments, dtype=torch.float32)
        scale = torch.repeat_interleave(seg, torch.tensor([s.inner, s.inner, gn, gn, s.num_heads]))
        scale = scale.to(m.in_proj.device)
        m.in_proj.copy_(m.in_proj.float() * (scale * mup.ssm_in)[:, None])
        if m.in_proj_bias is not None:
            m.in_proj_bias.copy_(m.in_proj_bias.float() * scale)
        m.out_proj.mul_(mup.ssm_out)
        if m.out_proj_bias is not None:
            m.out_proj_bias.mul_(mup.ssm_out)
        key = mup.key
        a.qkv_proj.mul_(mup.attention_in)
        a.qkv_proj[a.q_size:a.q_size + a.kv_size].mul_(key)
        if a.qkv_bias is not None:
            a.qkv_bias[a.q_size:a.q_size + a.kv_size].mul_(key)
        a.o_proj.mul_(mup.attention_out)
        if a.o_bias is not None:
            a.o_bias.mul_(mup.attention_out)
        gate, down = mup.mlp
        self.mlp.gate_up[:self.mlp.inter].mul_(gate)
        self.mlp.down.mul_(down)


class FalconH1ForCausalLM(LayerStack):
    family = "Falcon-H1"
    FINAL_NORM = "model.final_layernorm.weight"

    def make_layer(self, mc, layer_id, dtype, device):
        return FalconH1Layer(mc, layer_id, dtype, device)
