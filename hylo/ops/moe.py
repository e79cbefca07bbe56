"""Sparse mixture of experts: softmax router with top-k, and the routed expert SwiGLU MLPs.

Expert weights are held fused: ``w13[E, 2I, H]`` (gate rows then up rows) and ``w2[E, H, I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import narrow
from .pair_rows import SortedPairRows
from .triton_utils import use_triton


def route(router_logits: torch.Tensor, num_experts: int, top_k: int, normalize: bool, shared: bool,
          dtype: torch.dtype | None = None):
    """Routing of every token: its top-k experts and their weights; with ``shared``, the logits carry one more
    column, the shared expert's gate, and the shared expert (id ``num_experts``) is appended as one more pair with
    weight sigmoid(gate). The logits may also come as float32 split-K partials [T, S, E (+1)] (``ops.linear.narrow``),
    summed and rounded to ``dtype`` first. Returns (weights [T, k (+1)] in ``dtype``, default the logits', ids
    [T, k (+1)])."""
    if use_triton(router_logits):
        from .moe_route_triton import route as route_triton

        return route_triton(router_logits, num_experts, top_k, normalize, shared, dtype)
    if router_logits.dim() == 3:
        router_logits = router_logits.sum(1)
    if dtype is not None:
        router_logits = router_logits.to(dtype)
    weights, ids = route_topk(router_logits[:, :num_experts], top_k, normalize)
    if shared:
        gate = torch.sigmoid(router_logits[:, num_experts:])
        weights = torch.cat([weights, gate], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts)], dim=1)
    return weights, ids


def route_hidden(x: torch.Tensor, router: torch.Tensor, num_experts: int, top_k: int, normalize: bool,
                 shared: bool):
    """:func:`route` of the router's logits ``x @ router^T`` (router [E (+1), H]), in x's dtype: (weights, ids).
    On the few-row path the router GEMV hands the routing kernel its split-K partials (``ops.linear.narrow``).
    (Fusing the router GEMV and the routing into one launch, or the routing into the experts' gate/up kernel,
    was measured slower on the H200 and H100 and taken out again: docs/PERFORMANCE.md, sessions 12 to 20.)"""
    return route(narrow(x, router), num_experts, top_k, normalize, shared, x.dtype)


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool):
    """Softmax over experts in float32, top-k, optional renormalisation. Returns (weights in the logits' dtype,
    expert ids [T, k])."""
    probs = router_logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce: bool = True) -> "torch.Tensor | SortedPairRows":
    """[T, H] (the expert weights tensors or block-FP8 ``ops.fp8.Fp8Weight``); the Triton path with ``reduce=False`` returns the unreduced pair rows [T, J, H] instead, or, for
    large prefill chunks, :class:`SortedPairRows` (both for ``add_rms_norm`` to sum)."""
    if use_triton(x):
        from .fp8_triton import fp8_tiles_ok
        from .moe_triton import fused_moe as fused_moe_triton

        if not isinstance(w13, torch.Tensor) and not (fp8_tiles_ok(w13) and fp8_tiles_ok(w2)):
            w13, w2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)  # blocks the kernels' tiles cannot follow

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, reduce=reduce)
    if not isinstance(w13, torch.Tensor):  # block FP8 (ops.fp8.Fp8Weight): the reference dequantizes it whole
        w13, w2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Sum over each token's chosen experts of ``weight * down(silu(gate(x)) * up(x))``.

    x: [T, H]; topk_*: [T, k]. The reference groups tokens by expert (it reads the per-expert counts on the host);
    the fast kernels do the same grouping on the device.
    """
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[-1]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k  # token index of each sorted assignment
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        sel = order[start:start + count]
        tok = token_of[start:start + count]
        h = F.linear(x[tok], w13[expert])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        h = F.linear(h, w2[expert]) * topk_weights.reshape(-1)[sel, None]
        out.index_add_(0, tok, h.to(out.dtype))
        start += count
    return out
