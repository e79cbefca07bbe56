"""Sparse mixture of experts: softmax router with top-k, and the routed expert SwiGLU MLPs.

Expert weights are held fused: ``w13[E, 2I, H]`` (gate rows then up rows) and ``w2[E, H, I]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import narrow
from .norm import PendingAddNorm, add_rms_norm
from .triton_utils import use_triton

# HYLO_FUSED_ROUTER=1: the residual-add norm, the router GEMV and the routing in one launch (few tokens); =route:
# the router GEMV and the routing in one launch, the norm its own. Off by default (measured slower, session 12).
FUSED_ROUTER = os.environ.get("HYLO_FUSED_ROUTER", "0") in ("1", "route")
FUSED_NORM_ROUTER = os.environ.get("HYLO_FUSED_ROUTER") == "1"
# HYLO_ROUTE_IN_PAIRS=1: for a few tokens (batch-1 decode, a batch-1 verify) the routing inside the MoE's gate/up
# kernel: every pair's programs rank the token's experts from the router's logits themselves, so the routing
# kernel's launch goes (leaving the routing kernel out altogether took 74 us off the 1.504 ms batch-1 graph on the
# H200, ab-decode-20261204-211702: the most this can save). Off by default: with HYLO_NORM_IN_GEMV and
# HYLO_NORM_IN_ROUTER the batch-1 graph took 1.648 against 1.482 ms on the H200 (one round,
# ab-decode-20261205-133809), and alone on the H100 1.928 against 1.852 (session 19, ab-decode-20261205-141404).
ROUTE_IN_PAIRS = os.environ.get("HYLO_ROUTE_IN_PAIRS", "0") == "1"
# HYLO_NORM_IN_ROUTER=1: at one token the residual step before each MoE runs in the prologue of the router's GEMV
# (``ops.linear.narrow`` of a ``PendingAddNorm``), whose first block of programs also stores the normed row for the
# experts: one launch per layer fewer (the other 25 of the batch-1 step's 49 residual-add norms; the mixers' 24 are
# HYLO_NORM_IN_GEMV's). Each of the router's 144 programs sums the whole row and its delta rows from L2 for the sum
# of squares. Off by default: with the other two fusions the batch-1 graph took 1.648 against 1.482 ms on the H200
# (session 18, one round); alone it has not been measured yet.
NORM_IN_ROUTER = os.environ.get("HYLO_NORM_IN_ROUTER", "0") == "1"


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


@dataclass(frozen=True)
class RouterLogits:
    """Routing left to the expert kernels (:func:`moe_experts`): the router's logits of the tokens, or their float32
    split-K partials, which the gate/up kernel ranks itself (``moe_triton.fused_moe_routed``)."""

    logits: torch.Tensor


def route_hidden(x: torch.Tensor, router: torch.Tensor, num_experts: int, top_k: int, normalize: bool,
                 shared: bool, defer: bool = False):
    """:func:`route` of the router's logits ``x @ router^T`` (router [E (+1), H]), in x's dtype: (weights, ids).
    With ``defer`` the routing may be left to the expert kernels instead (a :class:`RouterLogits`, for
    :func:`moe_experts`): on the Triton path for a few tokens with ``HYLO_ROUTE_IN_PAIRS=1``.
    With ``HYLO_FUSED_ROUTER``, on the Triton path and for at most a few tokens (batch-1 decode and verify), the
    router GEMV and the routing are one launch (``moe_route_triton.router_route``); off by default: measured
    slower on the H200 (docs/PERFORMANCE.md, sessions 12 and 17)."""
    if _fused_router_fits(x, router):
        from .moe_route_triton import router_route

        return router_route(x, router, num_experts, top_k, normalize, shared)
    return _route_logits(narrow(x, router), x, num_experts, top_k, normalize, shared, defer)


def _route_logits(logits: torch.Tensor, x, num_experts: int, top_k: int, normalize: bool, shared: bool,
                  defer: bool):
    """The routing of the router's ``logits`` (or split partials) of the rows ``x`` (a tensor [T, H] or a
    ``PendingAddNorm`` of one), as :func:`route_hidden` returns it."""
    if defer and ROUTE_IN_PAIRS and use_triton(logits) and len(x.shape) == 2:
        from .moe_triton import routed_in_pairs_fits

        if routed_in_pairs_fits(x.shape[0], num_experts, top_k, shared):
            return RouterLogits(logits)
    return route(logits, num_experts, top_k, normalize, shared, x.dtype)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing, num_experts: int, top_k: int,
                normalize: bool, shared: bool, reduce: bool = True) -> torch.Tensor:
    """:func:`fused_moe` for ``routing`` as :func:`route_hidden` gives it: (weights, ids), or a
    :class:`RouterLogits` that the gate/up kernel routes from."""
    if isinstance(routing, RouterLogits):
        from .moe_triton import fused_moe_routed

        return fused_moe_routed(x, w13, w2, routing.logits, num_experts, top_k, normalize, shared, reduce=reduce)
    return fused_moe(x, w13, w2, *routing, reduce=reduce)


def _fused_router_fits(x: torch.Tensor, router: torch.Tensor) -> bool:
    """Whether the one-launch router kernels (``HYLO_FUSED_ROUTER``) take these rows x [M, H]: the Triton path, few
    rows, unit column stride, H a multiple of their 128-column blocks, a contiguous router."""
    if not (use_triton(x) and FUSED_ROUTER and x.dim() == 2):
        return False
    from .moe_route_triton import ROUTER_FUSED_MAX_TOKENS

    return (x.shape[0] <= ROUTER_FUSED_MAX_TOKENS and x.stride(-1) == 1 and x.shape[1] % 128 == 0
            and router.is_contiguous())


def add_norm_route(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   router: torch.Tensor, num_experts: int, top_k: int, normalize: bool, shared: bool):
    """The residual step before a MoE and its routing: ``add_rms_norm(x, delta, ...)``, then :func:`route_hidden`
    of the normed rows. Returns (new residual, normed rows, routing for :func:`moe_experts`). With
    ``HYLO_FUSED_ROUTER=1`` on the Triton path and for at most a few tokens, all of it is one launch
    (``moe_route_triton.norm_router_route``)."""
    if FUSED_NORM_ROUTER and _fused_router_fits(x, router) and norm_weight.is_contiguous():
        from .moe_route_triton import norm_router_route

        res, y, w, ids = norm_router_route(x, delta, norm_weight, eps, router, num_experts, top_k, normalize, shared)
        return res, y, (w, ids)
    if NORM_IN_ROUTER and not FUSED_ROUTER:  # the residual step in the router GEMV's prologue (one row)
        pending = PendingAddNorm(x, delta, norm_weight, eps)
        logits = narrow(pending, router)  # runs the step there when it fits, else before
        return (pending.new_residual(), pending.value(),
                _route_logits(logits, pending, num_experts, top_k, normalize, shared, defer=True))
    res, y = add_rms_norm(x, delta, norm_weight, eps)
    return res, y, route_hidden(y, router, num_experts, top_k, normalize, shared, defer=True)


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool):
    """Softmax over experts in float32, top-k, optional renormalisation. Returns (weights in the logits' dtype,
    expert ids [T, k])."""
    probs = router_logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """[T, H]; the Triton path with ``reduce=False`` returns the unreduced pair rows [T, k, H] instead."""
    if use_triton(x):
        from .moe_triton import fused_moe as fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, reduce=reduce)
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
