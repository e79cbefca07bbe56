"""RMSNorm variants: Qwen3-Next's (zero-centred, gated) and the Mamba2 families' plain one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_utils import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)``, computed in float32, returned in ``x``'s dtype."""
    if use_triton(x):
        from .norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta, weight: torch.Tensor, eps: float, plain: bool = False):
    """The residual stream step: ``(x + delta, rms_norm(x + delta))`` (one kernel on CUDA). A ``delta`` with one
    more dimension than ``x`` ([..., J, N]: unreduced MoE pair outputs, or a projection's split-K rows) adds the sum
    of its J rows, in float32; so does an ``ops.pair_rows.SortedPairRows`` (a large chunk's MoE rows in expert
    order), gathered by the kernel. ``plain``: the norm of ``rms_norm_plain`` (a plain weight applied in float32,
    the Mamba2 families'), else the zero-centred one."""
    if use_triton(x):
        from .norm_triton import add_rms_norm as add_rms_norm_triton

        return add_rms_norm_triton(x, delta, weight, eps, plain)
    if not isinstance(delta, torch.Tensor):  # SortedPairRows
        delta = delta.reduce().view(*x.shape[:-1], 1, x.shape[-1])
    if delta.dim() == x.dim() + 1:
        res = (x.float() + delta.float().sum(-2)).to(x.dtype)
    else:
        res = x + delta
    return res, rms_norm_plain(res, weight, eps) if plain else rms_norm_ref(res, weight, eps)


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float32: bool = True) -> torch.Tensor:
    """RMSNorm with a plain weight, ``x / rms(x) * w``: normalized in float32, then the weight applied in float32
    and rounded to x's dtype (Nemotron-H's), or with ``weight_in_float32=False`` rounded first and multiplied in x's
    dtype (Granite's, Llama's). The Mamba2 families' block and final norms. On CUDA one Triton pass, the weight
    applied in float32 either way (``weight_in_float32=False`` then differs from the reference by a rounding)."""
    if use_triton(x):
        from .norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, plain=True)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float32:
        return (weight.float() * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: ``(x / rms(x)) * w * silu(gate)`` with a plain (not zero-centred) weight, over each
    whole head (the Mamba2 families' grouped norms are ``ops.mamba2.gate_then_norm_ref`` / ``norm_then_gate_ref``).

    The order of casts follows the reference model: normalise in float32, scale by ``w`` in the input dtype, gate
    in float32.
    """
    if use_triton(x):
        from .norm_triton import gated_rms_norm_triton

        return gated_rms_norm_triton(x, gate, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return (y * F.silu(gate.float())).to(dtype)
