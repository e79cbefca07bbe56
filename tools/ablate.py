"""What-if timing: leave pieces of the decode step out, to bound what fusing them away could save.

    HYLO_ABLATE=addnorm,route python tools/ab_decode.py --variant base: --variant no-norm:HYLO_ABLATE=addnorm

``apply()`` (called by ``ab_decode``'s child before it builds the engine) replaces the named ops with versions
that launch nothing (or less) and return tensors of the right shapes. The model's outputs are then meaningless;
only the timing of what is left means something: the step's time without a piece is a lower bound for any fusion
that would make that piece free. Names:

- ``addnorm``: every residual-add RMSNorm (two per layer and the final one): the residual stays, h = x.
- ``route``: the router GEMV and the routing: fixed experts 0..k-1 (and the shared one) with weight 1/k.
- ``routek``: the routing kernel alone (the router GEMV still runs): the same fixed experts.
- ``conv``: the GDN decode conv: its input goes to the recurrent step as it is.
- ``gdn``: the GDN recurrent step: an uninitialised output (with ``route`` too: garbage logits would route every
  pair to the same expert, and the MoE would read one expert's weights instead of eleven).
- ``gdnnorm``: the gated RMSNorm inside the GDN output projection: a plain projection of the core output.
"""

from __future__ import annotations

import os

import torch

_FIXED: dict = {}


def _fixed_routing(tokens: int, top_k: int, shared: bool, num_experts: int, dtype, device):
    key = (tokens, top_k, shared, num_experts, dtype, device)
    if key not in _FIXED:  # made at the eager warm-up, before any graph capture
        kp = top_k + int(shared)
        ids = torch.arange(kp, device=device).repeat(tokens, 1)
        if shared:
            ids[:, -1] = num_experts
        _FIXED[key] = (torch.full((tokens, kp), 1.0 / kp, dtype=dtype, device=device), ids)
    return _FIXED[key]


def apply(names: list[str] | None = None) -> list[str]:
    """Patch the ops named in ``names`` (default: ``HYLO_ABLATE``, comma-separated). Returns the names applied."""
    if names is None:
        names = [n for n in os.environ.get("HYLO_ABLATE", "").split(",") if n]
    from hylo.models import hybrid
    from hylo.layers import moe as moe_layer
    from hylo.ops import conv1d_triton, gdn_triton, linear, moe

    for name in names:
        if name == "addnorm":
            def no_norm(x, delta, weight, eps):
                return x, x
            hybrid.add_rms_norm = no_norm
        elif name == "route":
            def fixed_route(x, router, num_experts, top_k, normalize, shared):
                return _fixed_routing(x.shape[0], top_k, shared, num_experts, x.dtype, x.device)
            moe_layer.route_hidden = fixed_route
        elif name == "routek":
            def fixed_topk(logits, num_experts, top_k, normalize, shared, dtype=None):
                return _fixed_routing(logits.shape[0], top_k, shared, num_experts, dtype or logits.dtype,
                                      logits.device)
            moe.route = fixed_topk
        elif name == "conv":
            conv1d_triton.conv_steps = lambda x, *args, **kw: x
        elif name == "gdn":
            def no_step(x, a, b, *args, **kw):
                return torch.empty(x.shape[0], a.shape[-1], args[6], dtype=x.dtype, device=x.device)
            gdn_triton.gdn_steps = no_step
        elif name == "gdnnorm":
            def plain_out(x, z, norm_weight, eps, w, reduce=True):
                return linear.out_proj(x.reshape(x.shape[0], -1), w, reduce=reduce)
            linear.norm_out_proj = plain_out
            from hylo.layers import linear_attn
            linear_attn.norm_out_proj = plain_out
        else:
            raise ValueError(f"HYLO_ABLATE: unknown piece {name!r}")
    return names
