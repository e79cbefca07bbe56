"""Triton routing for the MoE: softmax over the experts, top-k, optional renormalisation, and the folded shared
expert as one more pair, from the router's logits or from the float32 split-K partials of the router GEMV.

One program per token. The K choices come either as K max-reductions in turn (one warp), or, with
``HYLO_ROUTE_RANKED=1``, from each expert's rank among all of them ([E, E] comparisons at once, as
:func:`pair_choice` ranks): one reduction on the critical path instead of K. (Routing inside the decode gate/up
kernel instead, each program ranking its token's experts itself, was measured in session 7 and made batch-1 decode
1.73 -> 2.62 ms and batch 8 3.73 -> 9.91 ms: every one of a pair's 128 column-block programs redid the ranking.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .norm_triton import residual_sum
from .triton_pdl import pdl_enter
from .triton_utils import next_pow2, pdl_launch

# HYLO_ROUTE_RANKED=1: the routing kernel ranks the experts with [E, E] comparisons at once (4 warps) instead of K
# max-reductions in turn (one warp). Off: it made the batch-1 decode graph 0.037 ms slower on the H100 (1.889
# against 1.852 ms, session 19): the comparison's reduction across warps costs more than ten one-warp reductions.
ROUTE_RANKED = os.environ.get("HYLO_ROUTE_RANKED", "0") == "1"


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
def _expert_ranks(p, offs):
    """Each expert's rank by probability p (0: the most likely): how many others beat it, a higher probability or
    the same with a lower id. Padding (p = -1) ranks below every expert."""
    pi, pj = p[:, None], p[None, :]
    beats = (pj > pi) | ((pj == pi) & (offs[None, :] < offs[:, None]))
    return tl.sum(beats.to(tl.int32), 1)


@triton.jit
def _store_ranked(x, offs, t, w_ptr, ids_ptr, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                  NORM: tl.constexpr):
    """``_select_topk``'s routed pairs (not the shared one) from x [BR] float32 logits of token t's E experts: each
    expert of rank below K stores its id and weight at its rank."""
    m = offs < E
    p = _expert_probs(x, m)
    rank = _expert_ranks(p, offs)
    top = m & (rank < K)
    scale = 1.0 / tl.sum(tl.where(top, p, 0.0), 0) if NORM else 1.0
    tl.store(ids_ptr + t * KP + rank, offs.to(tl.int64), mask=top)
    tl.store(w_ptr + t * KP + rank, (p * scale).to(w_ptr.dtype.element_ty), mask=top)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, stride_l, stride_s, E: tl.constexpr, K: tl.constexpr,
                  KP: tl.constexpr, BE: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, SPLIT: tl.constexpr,
                  RANKED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Routing from precomputed logits [T, E (+1)], or from the float32 split-K partials [T, SPLIT, E (+1)] of the
    router GEMV (summed here, then rounded to the model's dtype as a plain matmul's logits are): one program per
    token. RANKED: BE >= E covers the experts alone, ranked at once (``_store_ranked``); the shared expert's gate
    is read as a block of its own."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    row = logits_ptr + t * stride_l
    DT: tl.constexpr = w_ptr.dtype.element_ty
    offs = tl.arange(0, BE)
    if RANKED:
        _store_ranked(_summed_logits(row, stride_s, offs, offs < E, SPLIT, DT), offs, t, w_ptr, ids_ptr, E, K, KP,
                      NORM)
        if SHARED:
            gate = E + tl.arange(0, 1)
            g = _summed_logits(row, stride_s, gate, gate >= 0, SPLIT, DT)
            tl.store(ids_ptr + t * KP + K + tl.arange(0, 1), gate.to(tl.int64))
            tl.store(w_ptr + t * KP + K + tl.arange(0, 1), (1.0 / (1.0 + tl.exp(-g))).to(DT))
    else:
        x = _summed_logits(row, stride_s, offs, offs < E + SHARED, SPLIT, DT)
        _select_topk(x, offs, t, w_ptr, ids_ptr, E, K, KP, NORM, SHARED)


@triton.jit
def pair_choice(lrow, stride_s, r, SPLIT: tl.constexpr, E: tl.constexpr, K: tl.constexpr, BE: tl.constexpr,
                NORM: tl.constexpr, SHARED: tl.constexpr, DT: tl.constexpr):
    """The expert (int64) and weight (in DT) of pair r of the token whose logits start at ``lrow`` (E experts, then
    with SHARED the shared expert's gate; SPLIT float32 partial rows ``stride_s`` apart, summed and rounded to DT),
    as ``_route_kernel`` routes: pair r < K is the expert of rank r by probability (ties to the lower id), pair K
    the shared expert. The ranks come from comparing every pair of experts ([BE, BE], BE >= E), not from K
    max-reductions in turn, so that the many programs that each route one pair for themselves stay short."""
    offs = tl.arange(0, BE)
    m = offs < E
    p = _expert_probs(_summed_logits(lrow, stride_s, offs, m, SPLIT, DT), m)
    rank = _expert_ranks(p, offs)
    mine = m & (rank == r)
    e = tl.sum(tl.where(mine, offs, 0), 0).to(tl.int64)
    w = tl.sum(tl.where(mine, p, 0.0), 0)
    if NORM:
        w = w * (1.0 / tl.sum(tl.where(m & (rank < K), p, 0.0), 0))
    if SHARED:  # the gate's column, as a one-element block
        gate = E + tl.arange(0, 1)
        g = tl.sum(_summed_logits(lrow, stride_s, gate, gate >= 0, SPLIT, DT), 0)
        e = tl.where(r == K, E, e)
        w = tl.where(r == K, 1.0 / (1.0 + tl.exp(-g)), w)
    return e, w.to(DT)


def _route_out(tokens: int, top_k: int, shared: bool, dtype: torch.dtype, device):
    kp = top_k + int(shared)
    return kp, torch.empty(tokens, kp, dtype=dtype, device=device), torch.empty(tokens, kp, dtype=torch.int64,
                                                                                device=device)


def _experts_block(num_experts: int, shared: bool) -> int:
    return max(16, next_pow2(num_experts + int(shared)))


def route(logits: torch.Tensor, num_experts: int, top_k: int, normalize: bool, shared: bool,
          dtype: torch.dtype | None = None):
    """logits: [T, E (+1 shared-gate column)], or float32 partial sums [T, S, E (+1)] whose sum is the logits.
    Returns (weights [T, k (+1)] in ``dtype`` (default: the logits' dtype), ids int64)."""
    tokens = logits.shape[0]
    split = logits.shape[1] if logits.dim() == 3 else 1
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    kp, w, ids = _route_out(tokens, top_k, shared, dtype or logits.dtype, logits.device)
    if tokens:
        ranked = ROUTE_RANKED and num_experts <= 128  # [E, E] comparisons: 16K at most
        be = max(16, next_pow2(num_experts)) if ranked else _experts_block(num_experts, shared)
        _route_kernel[(tokens,)](logits, w, ids, logits.stride(0), logits.stride(1) if split > 1 else 0,
                                 E=num_experts, K=top_k, KP=kp, BE=be, NORM=normalize, SHARED=shared, SPLIT=split,
                                 RANKED=ranked, num_warps=4 if ranked else 1, **pdl_launch(logits))
    return w, ids


# ---- the router GEMV and the routing in one launch (few tokens) ------------------------------------------------
@triton.jit
def _router_route_kernel(x_ptr, w_ptr, part_ptr, count_ptr, wts_ptr, ids_ptr, M, stride_x, H: tl.constexpr,
                         E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr,
                         BK: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, PREC: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Program s: the router logits' partial sum over hidden columns [s * BK, (s + 1) * BK) for the M (<= BM) tokens
    and every expert (and the shared expert's gate); the last program routes (``_route_partials``)."""
    pdl_enter(PDL)
    s = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    offs_e = tl.arange(0, BE)
    offs_k = s * BK + tl.arange(0, BK)
    mm = offs_m < M
    me = offs_e < E + SHARED
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mm[:, None], other=0.0)
    w = tl.load(w_ptr + offs_e[:, None] * H + offs_k[None, :], mask=me[:, None], other=0.0)
    part = tl.dot(x, tl.trans(w), input_precision=PREC)  # [BM, BE]
    _route_partials(part, part_ptr, count_ptr, wts_ptr, ids_ptr, M, E, K, KP, BE, BM, NORM, SHARED)


@triton.jit
def _route_partials(part, part_ptr, count_ptr, wts_ptr, ids_ptr, M, E: tl.constexpr, K: tl.constexpr,
                    KP: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr):
    """Store this program's partial logits [BM, BE]; the last program to finish (an atomic count, which also orders
    the other programs' stores before its loads) sums them, rounds them to the weights' dtype as a plain matmul's
    logits are, routes each of the M tokens as ``_route_kernel`` does, and resets the count for the next launch."""
    s = tl.program_id(0)
    splits = tl.num_programs(0)
    offs_m = tl.arange(0, BM)
    offs_e = tl.arange(0, BE)
    tl.store(part_ptr + (s * BM + offs_m[:, None]) * BE + offs_e[None, :], part)
    if tl.atomic_add(count_ptr, 1) == splits - 1:
        tl.atomic_xchg(count_ptr, 0)
        t = 0
        while t < M:
            logits = tl.zeros([BE], dtype=tl.float32)
            j = 0
            while j < splits:  # while loops: the interpreter cannot run a for loop with run-time bounds
                logits += tl.load(part_ptr + (j * BM + t) * BE + offs_e, cache_modifier=".cg")
                j += 1
            logits = logits.to(wts_ptr.dtype.element_ty).to(tl.float32)
            _select_topk(logits, offs_e, t, wts_ptr, ids_ptr, E, K, KP, NORM, SHARED)
            t += 1


@triton.jit
def _norm_router_route_kernel(x_ptr, d_ptr, nw_ptr, res_ptr, y_ptr, w_ptr, part_ptr, count_ptr, wts_ptr, ids_ptr,
                              M, eps, H: tl.constexpr, BH: tl.constexpr, J: tl.constexpr, E: tl.constexpr,
                              K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr,
                              BK: tl.constexpr, NORM: tl.constexpr, SHARED: tl.constexpr, PREC: tl.constexpr,
                              PDL: tl.constexpr = False):
    """The residual-add RMSNorm before the MoE (``norm_triton.add_rms_norm``) and the router of
    ``_router_route_kernel`` in one launch. Every program computes each row's sum of squares itself, one whole row
    (BH >= H columns) at a time, as the norm kernel does (the rows are few: M <= BM); then its own columns
    [s * BK, (s + 1) * BK): the new residual and the normed rows there, stored, and their partial router logits.
    The last program routes (``_route_partials``)."""
    pdl_enter(PDL)
    s = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    mm = offs_m < M
    offs_h = tl.arange(0, BH)
    inv = tl.zeros([BM], dtype=tl.float32)
    t = 0
    while t < M:  # while loops: the interpreter cannot run a for loop with run-time bounds
        row = t + tl.zeros([1], dtype=tl.int64)
        v = residual_sum(x_ptr, d_ptr, res_ptr, row, row >= 0, offs_h, H, J)
        inv = tl.where(offs_m == t, tl.rsqrt(tl.sum(tl.sum(v * v, 1), 0) / H + eps), inv)
        t += 1
    offs_k = s * BK + tl.arange(0, BK)
    rows = offs_m.to(tl.int64)
    v = residual_sum(x_ptr, d_ptr, res_ptr, rows, mm, offs_k, H, J)
    at = rows[:, None] * H + offs_k[None, :]
    tl.store(res_ptr + at, v.to(res_ptr.dtype.element_ty), mask=mm[:, None])
    nw = tl.load(nw_ptr + offs_k).to(tl.float32)
    y = (v * inv[:, None] * (1.0 + nw[None, :])).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + at, y, mask=mm[:, None])
    offs_e = tl.arange(0, BE)
    w = tl.load(w_ptr + offs_e[:, None] * H + offs_k[None, :], mask=(offs_e < E + SHARED)[:, None], other=0.0)
    part = tl.dot(y, tl.trans(w), input_precision=PREC)
    _route_partials(part, part_ptr, count_ptr, wts_ptr, ids_ptr, M, E, K, KP, BE, BM, NORM, SHARED)


ROUTER_FUSED_MAX_TOKENS = 4  # batch-1 decode and a batch-1 verify of k = 3; the last program routes them in turn
_ROUTER_SCRATCH: dict = {}  # device -> (partials, the count left at 0 by every launch)


def _scratch(splits: int, bm: int, be: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial logits and the count (left at 0 by every launch), allocated once per device (at the first,
    eager, launch: a graph's warm-up run comes before its capture)."""
    have = _ROUTER_SCRATCH.get(device)
    if have is None or have[0].numel() < splits * bm * be:
        have = _ROUTER_SCRATCH[device] = (torch.empty(splits * bm * be, dtype=torch.float32, device=device),
                                          torch.zeros(1, dtype=torch.int32, device=device))
    return have


def norm_router_route(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      router: torch.Tensor, num_experts: int, top_k: int, normalize: bool, shared: bool):
    """``add_rms_norm(x, delta, norm_weight, eps)``, then ``router_route`` of the normed rows, in one launch: x
    [M <= ROUTER_FUSED_MAX_TOKENS, H] (H a multiple of 128), delta [M, H] or [M, J, H] (unreduced rows, summed).
    Returns (new residual, normed rows, weights, ids)."""
    x = x.contiguous()
    delta = delta.contiguous()
    tokens, hidden = x.shape
    per_row = delta.shape[1] if delta.dim() == 3 else 1
    bk, bm, be = 128, 16, _experts_block(num_experts, shared)
    splits = hidden // bk
    kp, w, ids = _route_out(tokens, top_k, shared, x.dtype, x.device)
    res, y = torch.empty_like(x), torch.empty_like(x)
    part, count = _scratch(splits, bm, be, x.device)
    if tokens:
        _norm_router_route_kernel[(splits,)](x, delta, norm_weight, res, y, router, part, count, w, ids, tokens, eps,
                                             H=hidden, BH=triton.next_power_of_2(hidden), J=per_row,
                                             E=num_experts, K=top_k, KP=kp, BE=be, BM=bm, BK=bk, NORM=normalize,
                                             SHARED=shared,
                                             PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
                                             **pdl_launch(x))
    return res, y, w, ids


def router_route(x: torch.Tensor, router: torch.Tensor, num_experts: int, top_k: int, normalize: bool,
                 shared: bool):
    """``route(x @ router^T, ...)`` in one launch for x [M <= ROUTER_FUSED_MAX_TOKENS, H] (unit column stride) and
    router [E (+1), H] contiguous, H a multiple of 128. Returns (weights [M, k (+1)] in x's dtype, ids int64)."""
    tokens, hidden = x.shape
    bk, bm, be = 128, 16, _experts_block(num_experts, shared)
    splits = hidden // bk
    kp, w, ids = _route_out(tokens, top_k, shared, x.dtype, x.device)
    have = _scratch(splits, bm, be, x.device)
    if tokens:
        _router_route_kernel[(splits,)](x, router, have[0], have[1], w, ids, tokens, x.stride(0), H=hidden,
                                        E=num_experts, K=top_k, KP=kp, BE=be, BM=bm, BK=bk, NORM=normalize,
                                        SHARED=shared, PREC="ieee" if x.dtype == torch.float32 else "tf32",
                                        num_warps=4, **pdl_launch(x))
    return w, ids
