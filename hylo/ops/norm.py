"""RMSNorm variants of Qwen3-Next."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .triton_utils import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)``, computed in float32, returned in ``x``'s dtype."""
    if use_triton(x):
        from .norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual stream step: ``(x + delta, rms_norm(x + delta))`` (one kernel on CUDA). A ``delta`` with one
    more dimension than ``x`` ([..., J, N]: unreduced MoE pair outputs) adds the sum of its J rows, in float32."""
    if use_triton(x):
        from .norm_triton import add_rms_norm as add_rms_norm_triton

        return add_rms_norm_triton(x, delta, weight, eps)
    if delta.dim() == x.dim() + 1:
        res = (x.float() + delta.float().sum(-2)).to(x.dtype)
    else:
        res = x + delta
    return res, rms_norm_ref(res, weight, eps)


# HYLO_NORM_IN_GEMV=1: at one token (batch-1 decode) the residual step before each mixer runs in the prologue of the
# mixer's input projection (``PendingAddNorm``, ``ops.linear.dense``): one launch per layer fewer. Leaving all 49
# residual-add norms out of the batch-1 step took 0.090 ms off its 1.504 ms graph on the H200 (session 17,
# ab-decode-20261204-211702); these are 24 of them. Off by default: with HYLO_ROUTE_IN_PAIRS and HYLO_NORM_IN_ROUTER
# the batch-1 graph took 1.648 against 1.482 ms on the H200 (session 18, one round, ab-decode-20261205-133809);
# every program's pass over the row costs more than the launch it saves. Alone on the H100: 1.915 against 1.852 ms
# (session 19, ab-decode-20261205-141404).
NORM_IN_GEMV = os.environ.get("HYLO_NORM_IN_GEMV", "0") == "1"


class PendingAddNorm:
    """``add_rms_norm(x, delta, weight, eps)`` not yet run: the projection that reads its normed rows may run it in
    its own prologue (``ops.linear.dense``) and set ``residual``; anything else calls ``value()``, which runs it.
    Carries x's shape, dtype and device, which is all the mixers ask of their input besides projecting it."""

    def __init__(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
        self.x, self.delta, self.weight, self.eps = x, delta, weight, eps
        self.residual: torch.Tensor | None = None  # set by whichever runs the step
        self.normed: torch.Tensor | None = None  # likewise, where it keeps the normed rows

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def value(self) -> torch.Tensor:
        """The normed rows (running the residual step now unless a projection ran it)."""
        if self.normed is None:
            if self.residual is not None:
                raise RuntimeError("the residual step ran inside a projection: its normed rows are not kept")
            self.residual, self.normed = add_rms_norm(self.x, self.delta, self.weight, self.eps)
        return self.normed

    def new_residual(self) -> torch.Tensor:
        """x + delta, from whichever ran the step (running it now if nothing did)."""
        if self.residual is None:
            self.value()
        return self.residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: ``(x / rms(x)) * w * silu(gate)`` with a plain (not zero-centred) weight.

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
