"""Sparse mixture of experts: softmax router with top-k, and the routed experts' MLPs.

Expert weights are held fused: ``w13[E, 2I, H]`` (gate rows then up rows) and ``w2[E, H, I]`` for SwiGLU experts;
non-gated squared-ReLU experts (Nemotron 3's) hold only the up rows, ``w13[E, I, H]`` (``gated=False``).
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


def router_logits_f32(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """The float32 router logits of x [T, H] (the model's dtype) against a float32 router [E, H]: [T, E]; on the
    GPU at one token the one-row GEMV's float32 split-K rows [1, S, E] instead (the products of x's values, exact
    in float32, summed in float32), which ``grouped_sigmoid_route`` sums: no cast of x and no cuBLAS launch."""
    if x.shape[0] == 1 and use_triton(x) and x.stride(-1) == 1:
        from .linear_triton import SPLIT_GEMV_CFG, choose_split, gemv

        split = choose_split(router.shape[0], router.shape[1], SPLIT_GEMV_CFG[0], SPLIT_GEMV_CFG[1])
        if split > 1:  # (one split would come back in x's dtype)
            return gemv(x, router, split=split, fma=True)
    return F.linear(x.float(), router)


def grouped_sigmoid_route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                          normalize: bool, scaling: float, shared: int = 0):
    """Nemotron 3's (and DeepSeek-V3's) routing from float32 logits [T, E]: sigmoid scores; the correction bias
    added for the choice only; experts in ``n_group`` groups, each ranked by the sum of its two best biased scores,
    only the best ``topk_group`` groups eligible; the top ``top_k`` eligible experts by biased score, weighted by
    their unbiased scores (renormalised with ``normalize``) times ``scaling``; then ``shared`` more pairs, experts
    E .. E + shared - 1 with weight 1 (a shared expert folded in as that many routed-size experts). ``logits`` may
    come as float32 partial rows [T, S, E] whose sum is the logits (``router_logits_f32``). Returns
    (float32 weights [T, k + shared], int64 ids [T, k + shared]); on CUDA one Triton launch
    (``moe_route_triton.grouped_sigmoid_route``)."""
    if use_triton(logits):
        from .moe_route_triton import grouped_sigmoid_route as route_triton

        return route_triton(logits, bias, n_group, topk_group, top_k, normalize, scaling, shared)
    if logits.dim() == 3:
        logits = logits.sum(1)
    tokens, experts = logits.shape
    scores = logits.sigmoid()
    biased = scores + bias
    if n_group > 1:
        per_group = experts // n_group
        group_score = biased.view(tokens, n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        groups = group_score.topk(topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
        biased = biased.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = biased.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    if shared:
        fixed = torch.arange(experts, experts + shared, device=ids.device).expand(tokens, shared)
        ids = torch.cat([ids, fixed], 1)
        weights = torch.cat([weights, weights.new_ones(tokens, shared)], 1)
    return weights, ids


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce: bool = True, gated: bool = True) -> "torch.Tensor | SortedPairRows":
    """[T, H] (the expert weights tensors or block-FP8 ``ops.fp8.Fp8Weight``; ``gated=False``: squared-ReLU
    experts of up rows only); the Triton path with ``reduce=False`` returns the unreduced pair rows [T, J, H]
    instead, or, for large prefill chunks, :class:`SortedPairRows` (both for ``add_rms_norm`` to sum)."""
    if use_triton(x):
        from .fp8_triton import fp8_tiles_ok
        from .moe_triton import fused_moe as fused_moe_triton

        if not isinstance(w13, torch.Tensor) and not (fp8_tiles_ok(w13) and fp8_tiles_ok(w2)):
            w13, w2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)  # blocks the kernels' tiles cannot follow

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, reduce=reduce, gated=gated)
    if not isinstance(w13, torch.Tensor):  # block FP8 (ops.fp8.Fp8Weight): the reference dequantizes it whole
        w13, w2 = w13.dequantize(x.dtype), w2.dequantize(x.dtype)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, gated)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, gated: bool = True) -> torch.Tensor:
    """Sum over each token's chosen experts of ``weight * down(silu(gate(x)) * up(x))``, or with ``gated=False``
    of ``weight * down(relu(up(x)) ** 2)``; summed in float32, rounded to x's dtype once.

    x: [T, H]; topk_*: [T, k]. The reference groups tokens by expert (it reads the per-expert counts on the host);
    the fast kernels do the same grouping on the device.
    """
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[-1]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k  # token index of each sorted assignment
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        sel = order[start:start + count]
        tok = token_of[start:start + count]
        h = F.linear(x[tok], w13[expert])
        h = F.silu(h[:, :inter]) * h[:, inter:] if gated else torch.square(F.relu(h))
        h = F.linear(h, w2[expert]) * topk_weights.reshape(-1)[sel, None]
        out.index_add_(0, tok, h.to(out.dtype))
        start += count
    return out.to(x.dtype)
