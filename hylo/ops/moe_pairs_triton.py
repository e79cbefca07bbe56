"""Triton MoE for few (token, expert) pairs (decode, verify): one program row per pair, a GEMV over that pair's
expert, with no sorting at all, so the whole MoE is two launches after the routing kernel (an expert chosen by
several pairs is re-read from L2). The gate/up kernel writes each pair's activation; the down kernel sums a token's
pairs itself (one float32 row per token, which the residual add that follows reads), or writes one row per pair.
``moe_triton.fused_moe`` picks these kernels up to ``PAIR_GEMV_MAX_PAIRS`` pairs, the grouped GEMMs beyond.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_triton import fp8_kernel_args, row_tile, scaled_row_dot, weight_values
from .triton_pdl import l2_prefetch, pdl_enter
from .triton_utils import env_cfg, env_flag, next_pow2, pdl_launch, prefetch_args

# up to 16 tokens of 10 experts + the shared one: at 8 and 16 tokens the pair kernels beat the grouped GEMM and
# its alignment (94.6 vs 127 us and 153 vs 158 us per layer on bench-6b, tools/tune_kernels.py)
PAIR_GEMV_MAX_PAIRS = 176


@triton.jit
def expert_activation(gate, up, GATED: tl.constexpr):
    """An expert's activation in float32: SwiGLU's silu(gate) * up, or the non-gated squared ReLU, relu(up)^2."""
    if GATED:
        return gate / (1.0 + tl.exp(-gate)) * up
    r = tl.maximum(up, 0.0)
    return r * r


@triton.jit
def _pair_gate_up_kernel(x_ptr, w13_ptr, ids_ptr, act_ptr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False, s_ptr=None, S_E: tl.constexpr = 0, SK: tl.constexpr = 1, SBN: tl.constexpr = 1,
                         SBK: tl.constexpr = 1, FP8: tl.constexpr = False, GATED: tl.constexpr = True):
    """Program (pair, block of BN intermediate columns): silu(x W_gate^T) * (x W_up^T) of that pair's expert, or
    with GATED=False (experts of up rows only, [E, I, H]) relu(x W_up^T)^2 (with FP8, each K tile's partial sums
    times its rows' block scales: ``fp8_triton.block_scale``)."""
    pdl_enter(PDL)
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < I
    tok = pair // TOP_K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    UP0: tl.constexpr = I if GATED else 0  # the first up row of an expert
    w_base = w13_ptr + e * ((UP0 + I) * H)
    s_base = s_ptr + e * S_E if FP8 else s_ptr
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < H
        x = tl.load(x_ptr + tok * H + offs_k, mask=mk, other=0.0).to(tl.float32)
        m2 = mn[:, None] & mk[None, :]
        wu = tl.load(w_base + (UP0 + offs_n)[:, None] * H + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
        if FP8:  # each column block's partial sums times its rows' scales
            acc_u += scaled_row_dot(wu * x[None, :], s_base, UP0 + offs_n, mn, k0, SK, SBN, SBK, BN, BK)
        else:
            acc_u += tl.sum(wu * x[None, :], 1)
        if GATED:
            wg = tl.load(w_base + offs_n[:, None] * H + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            if FP8:
                acc_g += scaled_row_dot(wg * x[None, :], s_base, offs_n, mn, k0, SK, SBN, SBK, BN, BK)
            else:
                acc_g += tl.sum(wg * x[None, :], 1)
    act = expert_activation(acc_g, acc_u, GATED)
    tl.store(act_ptr + pair * I + offs_n, act.to(act_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _pair_down_kernel(act_ptr, w2_ptr, ids_ptr, wts_ptr, out_ptr, H: tl.constexpr, I: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, PF_LINES: tl.constexpr = 0, PF_STRIDE: tl.constexpr = 64,
                      PDL: tl.constexpr = False, s_ptr=None, S_E: tl.constexpr = 0, SK: tl.constexpr = 1, SBN: tl.constexpr = 1,
                         SBK: tl.constexpr = 1, FP8: tl.constexpr = False):
    """Program (pair, block of BN outputs): the pair's weighted down projection, one float32 row per pair. The
    rows of a token are summed by whoever reads them (the residual add), so every pair's weights stream in
    parallel instead of one program walking a token's pairs in turn.

    With PDL the expert ids are complete before this kernel starts: it is launched only once every program of the
    gate/up kernel has passed its own wait, i.e. after the routing kernel finished. So the program reads its
    expert and prefetches its weight rows into L2 before it waits for the gate/up activations."""
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < H
    if PDL and PF_LINES > 0:
        e = tl.load(ids_ptr + pair, cache_modifier=".cg").to(tl.int64)
        offs_l = tl.minimum(tl.arange(0, PF_LINES) * PF_STRIDE, I - 1)
        l2_prefetch(w2_ptr + e * (H * I) + tl.minimum(offs_n, H - 1)[:, None] * I + offs_l[None, :])
    pdl_enter(PDL)
    acc = _pair_down_row(act_ptr, w2_ptr, ids_ptr, pair, offs_n, mn, H, I, BN, BK, s_ptr, S_E, SK, SBN, SBK, FP8)
    acc = acc * tl.load(wts_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * H + offs_n, acc, mask=mn)


@triton.jit
def _pair_down_row(act_ptr, w2_ptr, ids_ptr, pair, offs_n, mn, H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr,
                   s_ptr, S_E: tl.constexpr, SK: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                   FP8: tl.constexpr):
    """Outputs ``offs_n`` of pair ``pair``'s down projection, unweighted, in float32: its activation row against
    its expert's rows of w2, BK columns at a time."""
    e = tl.load(ids_ptr + pair).to(tl.int64)
    w_base = w2_ptr + e * (H * I)
    s_base = s_ptr + e * S_E if FP8 else s_ptr
    acc = tl.zeros(offs_n.shape, dtype=tl.float32)
    for k0 in range(0, I, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < I
        a = tl.load(act_ptr + pair * I + offs_k, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_base + offs_n[:, None] * I + offs_k[None, :], mask=mn[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        if FP8:
            acc += scaled_row_dot(w * a[None, :], s_base, offs_n, mn, k0, SK, SBN, SBK, BN, BK)
        else:
            acc += tl.sum(w * a[None, :], 1)
    return acc


@triton.jit
def _pair_down_sum_kernel(act_ptr, w2_ptr, ids_ptr, wts_ptr, out_ptr, H: tl.constexpr, I: tl.constexpr,
                          TOP_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False,
                          s_ptr=None, S_E: tl.constexpr = 0, SK: tl.constexpr = 1, SBN: tl.constexpr = 1,
                         SBK: tl.constexpr = 1, FP8: tl.constexpr = False):
    """Program (token, block of BN outputs): the weighted down projections of the token's TOP_K pairs, summed in
    float32 into one row per token. Every pair's weight tile is loaded in the same program (the loop over pairs is
    unrolled), so the residual add that follows reads one row instead of TOP_K."""
    pdl_enter(PDL)
    tok = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < H
    acc = tl.zeros([BN], dtype=tl.float32)
    for p in tl.static_range(TOP_K):
        pair = tok * TOP_K + p
        part = _pair_down_row(act_ptr, w2_ptr, ids_ptr, pair, offs_n, mn, H, I, BN, BK, s_ptr, S_E, SK, SBN, SBK, FP8)
        acc += part * tl.load(wts_ptr + pair).to(tl.float32)
    tl.store(out_ptr + tok * H + offs_n, acc, mask=mn)


# launch parameters of the pair kernels (BN, BK, warps, stages), measured on the H200 (tools/tune_kernels.py,
# bench/results/tune-decode-20261202.json): down 8.2 us at 1 token and 35 us at 8 (down: by the number of pairs).
# Gate/up from tune_kernels --only pairs (tune-pairs-20261204-1322.json: with 2 stages, as the one-row GEMV): 12.9 us
# at 1 token (1.20x its bytes) and 56.9 at 8, against 13.7 and 59.9 with the previous (4, 256, 4, 1).
PAIR_GATE_UP_CFG = env_cfg("HYLO_PAIR_GATE_UP_CFG", (4, 1024, 2, 2))
# Non-gated experts (Nemotron 3's squared ReLU) load one weight tile per K step where gated ones load two. Twice
# the rows per program (8, the same bytes in flight) lost to these 4 rows in session 27's A/B on an H100
# (ab-decode-nemotron-3-nano-20261206-183548: 2.952 against 2.913 ms at batch 1, 7.990 against 7.956 at 8).
PAIR_UP_CFG = env_cfg("HYLO_PAIR_UP_CFG", (4, 1024, 2, 2))
PAIR_DOWN_CFG = ((32, (8, 512, 2, 1)), (PAIR_GEMV_MAX_PAIRS, (16, 512, 2, 1)))
# The down projections summed per token in the kernel (``_pair_down_sum_kernel``): the residual add that follows
# reads one float32 row per token instead of top_k (11 on bench-6b: the add-norm kernel took 3.0 us a layer at
# batch 1 reading them, against 1.5 for one row). HYLO_PAIR_DOWN_SUM=0 goes back to one row per pair. Its tile
# from tune_kernels --only pairs: one output column per one-warp program, 7.9 us at 1 token and 33.9 at 8, against
# the per-pair kernel's 8.3 and 35.1 (the first guess, (4, 512, 4, 1), took 11.8 at 1 token).
PAIR_DOWN_SUM = env_flag("HYLO_PAIR_DOWN_SUM", True)
PAIR_DOWN_SUM_CFG = env_cfg("HYLO_PAIR_DOWN_SUM_CFG", (1, 512, 1, 1))
# FP8 experts past one token: four output columns per two-warp program. Session 29's A/B on an H100 (bench-6b-fp8,
# ab-decode-bench-6b-fp8-pair-tiles-20261206-235853.json, the same call): batch 8 3.231 ms against 3.405 with the
# bfloat16 tile (-5%); at batch 1 1.449 against 1.423 (+2%), so one token keeps the one-column tile; on bfloat16
# experts the same tile lost at both (2.003 against 1.871 ms at batch 1, 4.610 against 4.414 at 8). An FP8 row of
# 512 columns is half a bfloat16 one's bytes: more of them per program keep enough loads in flight.
PAIR_DOWN_SUM_FP8_CFG = env_cfg("HYLO_PAIR_DOWN_SUM_FP8_CFG", (4, 512, 2, 1))


def pair_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
             top_k: int, reduce: bool, gated: bool) -> torch.Tensor:
    """The pair kernels (few pairs): gate/up, then the down projection summed per token (or one row per pair)."""
    num_tokens, hidden = x.shape
    num_pairs, inter = ids.shape[0], w2.shape[-1]
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    # (an FP8 expert's K tiles may span several column blocks here: ``fp8_triton.scaled_row_dot``)
    bn, bk, warps, stages = PAIR_GATE_UP_CFG if gated else PAIR_UP_CFG
    _pair_gate_up_kernel[(num_pairs, triton.cdiv(inter, bn))](
        x, weight_values(w13), ids, act, hidden, inter, TOP_K=top_k, BN=bn,
        BK=row_tile(min(bk, next_pow2(hidden)), w13, hidden), GATED=gated, num_warps=warps, num_stages=stages, **pdl_launch(x), **fp8_kernel_args(w13))
    if PAIR_DOWN_SUM:  # one float32 row per token, [T, 1, H]
        fp8_rows = not isinstance(w2, torch.Tensor) and num_tokens > 1
        bn, bk, warps, stages = PAIR_DOWN_SUM_FP8_CFG if fp8_rows else PAIR_DOWN_SUM_CFG
        out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=x.device)
        _pair_down_sum_kernel[(num_tokens, triton.cdiv(hidden, bn))](
            act, weight_values(w2), ids, wts, out, hidden, inter, TOP_K=top_k, BN=bn,
            BK=row_tile(min(bk, next_pow2(inter)), w2, inter), num_warps=warps, num_stages=stages, **pdl_launch(x), **fp8_kernel_args(w2))
        return out.to(x.dtype) if reduce else out.view(num_tokens, 1, hidden)
    bn, bk, warps, stages = next((cfg for limit, cfg in PAIR_DOWN_CFG if num_pairs <= limit), PAIR_DOWN_CFG[-1][1])
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _pair_down_kernel[(num_pairs, triton.cdiv(hidden, bn))](
        act, weight_values(w2), ids, wts, out, hidden, inter, BN=bn, BK=row_tile(min(bk, next_pow2(inter)), w2, inter),
        num_warps=warps, num_stages=stages, **prefetch_args(inter, weight_values(w2)), **pdl_launch(x),
        **fp8_kernel_args(w2))
    out = out.view(num_tokens, top_k, hidden)
    return out.sum(1, dtype=torch.float32).to(x.dtype) if reduce else out
