"""Triton routing for the MoE: softmax over the experts, top-k, optional renormalisation, and the folded shared
expert as one more pair, from the router's logits or from the float32 split-K partials of the router GEMV; and
Nemotron 3's grouped sigmoid routing (``grouped_sigmoid_route``).

One program per token, one warp: the K choices come as K max-reductions in turn. Measured and taken out again
(docs/PERFORMANCE.md): ranking every expert at once with [E, E] comparisons (0.037 ms slower per batch-1 step on
the H100, session 19: the reduction across warps costs more than ten one-warp reductions); the router GEMV and
the routing in one launch, with or without the residual-add norm before them (sessions 12 and 17); and the
routing inside the experts' gate/up kernel, each program ranking its token's experts itself (sessions 7 and 18).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import pdl_enter
from .triton_utils import next_pow2, pdl_launch


@triton.jit
def _summed_logits(row_ptr, stride_s, offs, m, SPLIT: tl.constexpr, DT: tl.constexpr):
    """Columns ``offs`` of one token's router logits in float32: its row, or the sum of its SPLIT float32 split-K
    partial rows ``stride_s`` apart, rounded to DT as a plain matmul's logits are; 0 outside ``m``."""
    x = tl.load(row_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if SPLIT > 1:
        for s in tl.static_range(1, SPLIT):
            x += tl.load(row_ptr + s * stride_s + offs, mask=m, other=0.0)
        x = x.to(DT).to(tl.float32)
    return x


@triton.jit
def _expert_probs(x, m):
    """Softmax of the logits x over the experts ``m``; -1 outside them (below every probability: never chosen)."""
    xe = tl.where(m, x, float("-inf"))
    p = tl.exp(xe - tl.max(xe, 0))
    p = p / tl.sum(p, 0)
    return tl.where(m, p, -1.0)


@triton.jit
def _select_topk(x, offs, t, w_ptr, ids_ptr, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 NORM: tl.constexpr, SHARED: tl.constexpr):
    """x: [BE] float32 logits of token t (column E: the shared expert's gate). Softmax over the E experts, top-K,
    optional renormalisation, stored as pairs 0..K-1; with SHARED, the shared expert (id E) as pair K with weight
    sigmoid(gate). One pass of K max-reductions: each chosen expert's rank is kept, and the weights are stored by
    rank once their sum is known."""
    p = _expert_probs(x, offs < E)
    q = p
    rank = tl.full(x.shape, -1, tl.int32)
    total = 0.0
    for j in tl.static_range(K):
        best, idx = tl.max(q, 0, return_indices=True, return_indices_tie_break_left=True)
        total += best
        tl.store(ids_ptr + t * KP + j, idx.to(tl.int64))
        rank = tl.where(offs == idx, j, rank)
        q = tl.where(offs == idx, -1.0, q)
    scale = 1.0 / total if NORM else 1.0
    tl.store(w_ptr + t * KP + rank, (p * scale).to(w_ptr.dtype.element_ty), mask=rank >= 0)
    if SHARED:
        g = tl.sum(tl.where(offs == E, x, 0.0), 0)
        tl.store(ids_ptr + t * KP + K, E)
        tl.store(w_ptr + t * KP + K, (1.0 / (1.0 + tl.exp(-g))).to(w_ptr.dtype.element_ty))


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, stride_l, stride_s, E: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, BE: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, SPLIT: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Routing from precomputed logits [T, E (+1)], or from the float32 split-K partials [T, SPLIT, E (+1)] of the
    router GEMV (summed here, then rounded to the model's dtype as a plain matmul's logits are): one program per
    token."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BE)
    x = _summed_logits(logits_ptr + t * stride_l, stride_s, offs, offs < E + SHARED, SPLIT, w_ptr.dtype.element_ty)
    _select_topk(x, offs, t, w_ptr, ids_ptr, E, K, KP, NORM, SHARED)


def route(logits: torch.Tensor, num_experts: int, top_k: int, normalize: bool, shared: bool,
          dtype: torch.dtype | None = None):
    """logits: [T, E (+1 shared-gate column)], or float32 partial sums [T, S, E (+1)] whose sum is the logits.
    Returns (weights [T, k (+1)] in ``dtype`` (default: the logits' dtype), ids int64)."""
    tokens = logits.shape[0]
    split = logits.shape[1] if logits.dim() == 3 else 1
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    kp = top_k + int(shared)
    w = torch.empty(tokens, kp, dtype=dtype or logits.dtype, device=logits.device)
    ids = torch.empty(tokens, kp, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, w, ids, logits.stride(0), logits.stride(1) if split > 1 else 0,
                                 E=num_experts, K=top_k, KP=kp, BE=max(16, next_pow2(num_experts + int(shared))),
                                 NORM=normalize, SHARED=shared, SPLIT=split, num_warps=1, **pdl_launch(logits))
    return w, ids


@triton.jit
def _grouped_sigmoid_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, scaling, E: tl.constexpr, K: tl.constexpr,
                            BE: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, PG: tl.constexpr,
                            TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr = 0,
                            SPLIT: tl.constexpr = 1):
    """One program per token: sigmoid scores of the float32 logits [T, E], plus the correction bias for the
    choice; with G > 1 groups of PG experts, each group ranked by the sum of its two best biased scores and all but
    the best TOPK_GROUP groups left out; then the top K by biased score, weighted by their unbiased scores
    (renormalised with NORM) times ``scaling``; then SHARED pairs of experts E, E + 1, ... with weight 1 (the
    folded shared expert). SPLIT > 1: the logits are the sum of a token's SPLIT float32 partial rows."""
    KP: tl.constexpr = K + SHARED
    t = tl.program_id(0)
    offs = tl.arange(0, BE)
    m = offs < E
    scores = tl.load(logits_ptr + t * SPLIT * E + offs, mask=m, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        scores += tl.load(logits_ptr + (t * SPLIT + s) * E + offs, mask=m, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-scores))
    bias = tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32)
    biased = tl.where(m, scores + bias, float("-inf"))
    if G > 1:
        group = offs // PG
        offs_g = tl.arange(0, BG)
        group_score = tl.full(offs_g.shape, float("-inf"), tl.float32)
        for g in tl.static_range(G):
            mine = tl.where(group == g, biased, float("-inf"))
            best, idx = tl.max(mine, 0, return_indices=True, return_indices_tie_break_left=True)
            second = tl.max(tl.where(offs == idx, float("-inf"), mine), 0)
            group_score = tl.where(offs_g == g, best + second, group_score)
        keep = tl.zeros(offs.shape, tl.int1)
        for j in tl.static_range(TOPK_GROUP):
            _, gi = tl.max(group_score, 0, return_indices=True, return_indices_tie_break_left=True)
            keep = keep | (group == gi)
            group_score = tl.where(offs_g == gi, float("-inf"), group_score)
        biased = tl.where(keep, biased, float("-inf"))
    rank = tl.full(offs.shape, -1, tl.int32)
    total = 0.0
    for j in tl.static_range(K):
        _, idx = tl.max(biased, 0, return_indices=True, return_indices_tie_break_left=True)
        total += tl.sum(tl.where(offs == idx, scores, 0.0), 0)
        tl.store(ids_ptr + t * KP + j, idx.to(tl.int64))
        rank = tl.where(offs == idx, j, rank)
        biased = tl.where(offs == idx, float("-inf"), biased)
    scale = scaling / (total + 1e-20) if NORM else scaling
    tl.store(w_ptr + t * KP + rank, (scores * scale).to(w_ptr.dtype.element_ty), mask=rank >= 0)
    for j in tl.static_range(SHARED):
        tl.store(ids_ptr + t * KP + K + j, E + j)
        tl.store(w_ptr + t * KP + K + j, 1.0)


def grouped_sigmoid_route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                          normalize: bool, scaling: float, shared: int = 0):
    """Nemotron 3's routing (``ops.moe.grouped_sigmoid_route``) in one launch: logits float32 [T, E] (or partial
    rows [T, S, E], summed here), bias float32 [E]. Returns (float32 weights [T, k + shared], int64 ids
    [T, k + shared])."""
    tokens, experts = logits.shape[0], logits.shape[-1]
    split = logits.shape[1] if logits.dim() == 3 else 1
    logits = logits.contiguous()
    w = torch.empty(tokens, top_k + shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k + shared, dtype=torch.int64, device=logits.device)
    if tokens:
        _grouped_sigmoid_kernel[(tokens,)](logits, bias, w, ids, float(scaling), E=experts, K=top_k,
                                           BE=max(16, next_pow2(experts)), G=n_group, BG=max(2, next_pow2(n_group)),
                                           PG=experts // n_group,
                                           TOPK_GROUP=topk_group, NORM=normalize, SHARED=shared, SPLIT=split,
                                           num_warps=1)
    return w, ids
