"""Triton fused MoE: the routed experts' SwiGLU MLPs without a per-expert Python loop, reading only the chosen
experts' weights.

Three layouts of the (token, expert) pairs, picked by their number P = tokens * top_k:
- few pairs (decode; ``moe_pairs_triton``): one program row per pair, a GEMV over that pair's expert. No sorting,
  so the whole MoE is two launches after the routing kernel; an expert chosen by several pairs is re-read from L2.
- many pairs (large prefill chunks on Hopper and later): ``torch._grouped_mm`` (``moe_grouped_mm``), whose rows
  stay in expert order until the residual add gathers and sums them (``ops.pair_rows.SortedPairRows``).
- many pairs elsewhere (decode batches beyond the pair kernels, older GPUs, float32): pairs sorted by expert into
  blocks of BM that each belong to one expert (padding with a sentinel pair), then a grouped GEMM with
  tensor-core dots. The sort runs on the device with fixed-size outputs, so it needs no host sync and can be
  captured in a CUDA graph.
The grouped kernels write one row per pair (weighted by its routing weight); the k rows of a token are summed at
the end, or, in the model, by the residual add that follows (``norm_triton.add_rms_norm`` takes them unreduced).
The pair kernels' down projection sums a token's pairs itself (one row per token).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8_triton import block_scale, fp8_kernel_args, weight_values
from .moe_pairs_triton import PAIR_GEMV_MAX_PAIRS, expert_activation, pair_moe
from .pair_rows import SortedPairRows
from .moe_grouped_mm import fused_moe_grouped_mm, grouped_mm_usable
from .triton_utils import env_flag, next_pow2


# ---- many pairs: grouped GEMM over expert-sorted blocks --------------------------------------------------------
@triton.jit
def _expert_tile(acc, x, w_base, rows, mn, offs_k, mk, k0, K: tl.constexpr, s_base, SK: tl.constexpr,
                 SBN: tl.constexpr, SBK: tl.constexpr, FP8: tl.constexpr, SWAP: tl.constexpr, PREC: tl.constexpr):
    """acc plus one K tile's products of the block's rows with the expert's weight rows ``rows`` (K columns each,
    from ``w_base``): x [BM, BK] and acc [BM, BN]; with SWAP, x^T [BK, BM] and acc^T [BN, BM], the weight tile the
    dot's first operand (on Hopper the first operand may come from registers, where an FP8 tile converted to x's
    dtype already is, instead of going back through shared memory; the block's few rows are the dot's N). FP8
    values are exact in x's dtype: the dot on them, then the tile's one scale per weight row."""
    if SWAP:
        w = tl.load(w_base + rows[:, None] * K + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        if FP8:
            out = acc + tl.dot(w.to(x.dtype), x, input_precision=PREC) * block_scale(s_base, rows, mn, k0, SK, SBN,
                                                                                    SBK)[:, None]
        else:
            out = tl.dot(w, x, acc, input_precision=PREC)
    else:
        w = tl.load(w_base + rows[None, :] * K + offs_k[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        if FP8:
            out = acc + tl.dot(x, w.to(x.dtype), input_precision=PREC) * block_scale(s_base, rows, mn, k0, SK, SBN,
                                                                                    SBK)[None, :]
        else:
            out = tl.dot(x, w, acc, input_precision=PREC)
    return out


@triton.jit
def _block_rows(ptr, rows, mp, offs_k, mk, K: tl.constexpr, SWAP: tl.constexpr):
    """Rows ``rows`` of a [*, K] matrix at columns ``offs_k``: [BM, BK], or with SWAP transposed, [BK, BM]."""
    if SWAP:
        out = tl.load(ptr + rows[None, :] * K + offs_k[:, None], mask=mp[None, :] & mk[:, None], other=0.0)
    else:
        out = tl.load(ptr + rows[:, None] * K + offs_k[None, :], mask=mp[:, None] & mk[None, :], other=0.0)
    return out


@triton.jit
def _grouped_gate_up_kernel(x_ptr, w13_ptr, sorted_ptr, block_expert_ptr, act_ptr, H: tl.constexpr,
                            I: tl.constexpr, P,
                            TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            PREC: tl.constexpr, s_ptr=None, S_E: tl.constexpr = 0, SK: tl.constexpr = 1,
                            SBN: tl.constexpr = 1, SBK: tl.constexpr = 1, FP8: tl.constexpr = False,
                            GATED: tl.constexpr = True, SWAP: tl.constexpr = False):
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    if e < 0:
        return
    pairs = tl.load(sorted_ptr + blk * BM + tl.arange(0, BM))
    mp = pairs < P
    toks = pairs // TOP_K
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < I
    UP0: tl.constexpr = I if GATED else 0  # the first up row of an expert (GATED: gate rows first)
    w_base = w13_ptr + e * ((UP0 + I) * H)
    s_base = s_ptr + e * S_E if FP8 else s_ptr
    shape: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
    acc_g = tl.zeros(shape, dtype=tl.float32)
    acc_u = tl.zeros(shape, dtype=tl.float32)
    for k0 in range(0, H, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < H
        x = _block_rows(x_ptr, toks, mp, offs_k, mk, H, SWAP)
        acc_u = _expert_tile(acc_u, x, w_base, UP0 + offs_n, mn, offs_k, mk, k0, H, s_base, SK, SBN, SBK, FP8, SWAP,
                             PREC)
        if GATED:
            acc_g = _expert_tile(acc_g, x, w_base, offs_n, mn, offs_k, mk, k0, H, s_base, SK, SBN, SBK, FP8, SWAP,
                                 PREC)
    if SWAP:
        acc_g, acc_u = tl.trans(acc_g), tl.trans(acc_u)
    act = expert_activation(acc_g, acc_u, GATED)
    tl.store(act_ptr + pairs[:, None] * I + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=mp[:, None] & mn[None, :])


@triton.jit
def _grouped_down_kernel(act_ptr, w2_ptr, sorted_ptr, block_expert_ptr, wts_ptr, out_ptr, H: tl.constexpr,
                         I: tl.constexpr, P,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                         s_ptr=None, S_E: tl.constexpr = 0, SK: tl.constexpr = 1, SBN: tl.constexpr = 1,
                         SBK: tl.constexpr = 1, FP8: tl.constexpr = False, SWAP: tl.constexpr = False):
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    if e < 0:
        return
    pairs = tl.load(sorted_ptr + blk * BM + tl.arange(0, BM))
    mp = pairs < P
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = offs_n < H
    w_base = w2_ptr + e * (H * I)
    s_base = s_ptr + e * S_E if FP8 else s_ptr
    acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < I
        a = _block_rows(act_ptr, pairs, mp, offs_k, mk, I, SWAP)
        acc = _expert_tile(acc, a, w_base, offs_n, mn, offs_k, mk, k0, I, s_base, SK, SBN, SBK, FP8, SWAP, PREC)
    if SWAP:
        acc = tl.trans(acc)
    wts = tl.load(wts_ptr + pairs, mask=mp, other=0.0).to(tl.float32)
    acc = acc * wts[:, None]
    tl.store(out_ptr + pairs[:, None] * H + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mp[:, None] & mn[None, :])


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, P, num_blocks, BM: tl.constexpr, BE: tl.constexpr,
                  BP: tl.constexpr, BB: tl.constexpr):
    """Program e: expert e's pairs, in pair order, into its run of blocks. Every program counts all experts' pairs
    (a histogram per chunk of BP pairs) so that it knows where its run starts; no other program's result is
    needed, so the whole alignment is one launch. Program 0 also marks the blocks past the last run unused. Up to
    BP pairs (4096) each pass is one iteration: a loop of small chunks made 2816 pairs slower than the torch ops
    this replaced (the running count is a serial chain)."""
    e = tl.program_id(0)
    offs_e = tl.arange(0, BE)
    hist = tl.zeros([BE], dtype=tl.int32)
    p0 = 0
    while p0 < P:  # while loops throughout: Triton's interpreter cannot run a for loop with run-time bounds
        offs = p0 + tl.arange(0, BP)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=0).to(tl.int32)
        hist += tl.histogram(ids, BE, mask=offs < P)
        p0 += BP
    padded = (hist + BM - 1) // BM * BM
    start = tl.sum(tl.where(offs_e < e, padded, 0), 0)
    count = tl.sum(tl.where(offs_e == e, hist, 0), 0)
    run_len = tl.sum(tl.where(offs_e == e, padded, 0), 0)
    total = tl.sum(padded, 0)
    seen = tl.sum(tl.zeros([BE], dtype=tl.int32), 0)
    p0 = 0
    while p0 < P:
        offs = p0 + tl.arange(0, BP)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        mine = (ids == e).to(tl.int32)
        rank = seen + tl.cumsum(mine, 0) - 1
        tl.store(sorted_ptr + start + rank, offs.to(tl.int64), mask=mine > 0)
        seen += tl.sum(mine, 0)
        p0 += BP
    offs_m = tl.arange(0, BM)
    tl.store(sorted_ptr + start + count + offs_m, tl.full([BM], 0, tl.int64) + P, mask=count + offs_m < run_len)
    b0 = start // BM
    while b0 < (start + run_len) // BM:
        offs_b = b0 + tl.arange(0, BB)
        tl.store(block_expert_ptr + offs_b, tl.full([BB], 0, tl.int64) + e, mask=offs_b < (start + run_len) // BM)
        b0 += BB
    if e == 0:
        b0 = total // BM
        while b0 < num_blocks:
            offs_b = b0 + tl.arange(0, BB)
            tl.store(block_expert_ptr + offs_b, tl.full([BB], -1, tl.int64), mask=offs_b < num_blocks)
            b0 += BB


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, expert) pairs by expert into blocks of ``block_m`` that each hold one expert's pairs, in
    one launch (``_align_kernel``).

    Returns (sorted_pairs [num_blocks * block_m] with the sentinel P for padding, block_expert [num_blocks] with
    -1 for unused blocks; the pair slots of unused blocks are left unwritten: no kernel reads them). Output sizes
    depend only on (P, E, block_m): no host sync, graph-capturable.
    """
    flat = topk_ids.reshape(-1).contiguous()
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=flat.device)
    bp = max(16, min(next_pow2(num_pairs), 4096))
    _align_kernel[(num_experts,)](flat, sorted_pairs, block_expert, num_pairs, num_blocks, BM=block_m,
                                  BE=next_pow2(num_experts), BP=bp, BB=64, num_warps=4 if bp <= 1024 else 8)
    return sorted_pairs, block_expert


# grouped kernels (BM, BN, BK, warps, stages) by number of pairs. BM = 64 by default: each block re-reads its
# expert's weights, so at decode batches (where the shared expert and popular experts have tens of pairs)
# smaller blocks multiply the bytes read. Measured on the H200: BN = 128 with 8 warps made the 8192-token prefill
# 4x slower than this. But at verify and decode-batch sizes, 16-row blocks with BK = 128 are faster
# (``tools/tune_kernels.py --only grouped`` on the H200, whole MoE layer: 32 tokens 130 -> 117 us, 64 tokens
# 146 -> 136 us, against floors of 95; at 256 tokens the 64-row blocks stay best, 243 us).
# A config may carry a second (BN, BK, warps, stages) for the down kernel (K = I, N = H: a different shape from
# gate/up's); without one, the down kernel takes gate/up's. Session 8's sweep (``tune-grouped-20261203-1246.json``)
# found its own tiles best for the down kernel above 1024 pairs (BN = 128: the whole MoE at 256 tokens 125.2 ->
# 122.5 us, floor 95.5) and gate/up's below. HYLO_GROUPED_CFG replaces the table at start-up, as
# ``tools/tune_kernels.py --env`` writes it: "1024:16,64,128,4,3;max:64,64,64,4,3,128,64,4,3".
GROUPED_CFG = ((1024, (16, 64, 128, 4, 3)), (1 << 62, (64, 64, 64, 4, 3, 128, 64, 4, 3)))


def parse_grouped_cfg(text: str, var: str = "HYLO_GROUPED_CFG") -> tuple:
    """``"LIMIT:BM,BN,BK,W,S[,BN,BK,W,S];..."`` (LIMIT a pair count or ``max``) -> a GROUPED_CFG table."""
    table = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        limit, _, cfg = part.partition(":")
        try:
            values = tuple(int(v) for v in cfg.split(","))
            bound = 1 << 62 if limit.strip() == "max" else int(limit)
        except ValueError:
            values, bound = (), 0
        if len(values) not in (5, 9) or min(values) < 1 or bound < 1:
            raise ValueError(f"{var} entry {part!r}: expected a pair limit (a positive integer or 'max'), then 5 or "
                             f"9 positive integers")
        if table and bound <= table[-1][0]:
            raise ValueError(f"{var} entry {part!r}: the pair limits must increase")
        table.append((bound, values))
    if not table or table[-1][0] != 1 << 62:
        raise ValueError(f"{var} {text!r}: the last entry's limit must be 'max'")
    return tuple(table)


if os.environ.get("HYLO_GROUPED_CFG"):
    GROUPED_CFG = parse_grouped_cfg(os.environ["HYLO_GROUPED_CFG"])
# Block-FP8 experts' table (same form; HYLO_GROUPED_FP8_CFG replaces it). bfloat16 experts on Hopper leave these
# kernels to torch._grouped_mm past a few hundred pairs, but FP8 ones stay here at every size (BK <= SBK caps an FP8
# tile at its block's 128 columns). Up to 4096 pairs (decode and verify: 455 tokens of 8 routed experts and the
# shared one): the tiles that ``tools/tune_fp8.py`` measured best at the Qwen3.5-35B-A3B shape on an H100 at 64 and
# 256 tokens (session 32: 1.63x and 1.71x the expert bytes' floor; the bs64 MTP verify step took 30.1 ms with them,
# 39.7 ms with the bfloat16 table's tiles). Past that (prefill): the bfloat16 table's large tile, which ran the
# 8192-token prefill in 177 ms against 265 ms with the small one.
GROUPED_FP8_CFG = ((4096, (16, 32, 128, 4, 3, 64, 128, 4, 3)), GROUPED_CFG[-1])
if os.environ.get("HYLO_GROUPED_FP8_CFG"):
    GROUPED_FP8_CFG = parse_grouped_cfg(os.environ["HYLO_GROUPED_FP8_CFG"], "HYLO_GROUPED_FP8_CFG")
# The FP8 tiles' dot with its operands swapped (``_expert_tile``); off: slower at both sizes swept (session 32, H100:
# 336 against 322 us at 256 tokens, 279 against 269 us at 64).
GROUPED_FP8_SWAP = env_flag("HYLO_GROUPED_FP8_SWAP", False)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce: bool = True, gated: bool = True) -> "torch.Tensor | SortedPairRows":
    """x: [T, H]; w13: [E, 2I, H] (gated: SwiGLU experts) or [E, I, H] (``gated=False``: squared-ReLU experts);
    w2: [E, H, I]; topk_*: [T, k]. Returns [T, H] in x's dtype, or with
    ``reduce=False`` float32 rows [T, J, H] whose sum over J is the result, for the caller to sum (``add_rms_norm``
    does): the weighted row of every pair (J = k), or rows summed per token already (J = 1); through
    ``torch._grouped_mm``, the pairs' rows in expert order (``ops.pair_rows.SortedPairRows``), which ``add_rms_norm``
    also sums."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w2.shape[-1]
    if w13.shape[1] != (2 if gated else 1) * inter:
        raise ValueError(f"expert weights {tuple(w13.shape)} and {tuple(w2.shape)} do not make "
                         f"{'gated' if gated else 'non-gated'} experts")
    num_pairs = num_tokens * top_k
    fp8 = not isinstance(w13, torch.Tensor)  # block FP8 (ops.fp8.Fp8Weight): the Triton kernels dequantize as they load
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    if num_pairs == 0:
        return torch.zeros_like(x) if reduce else x.new_zeros(num_tokens, top_k, hidden)
    if num_pairs <= PAIR_GEMV_MAX_PAIRS:
        return pair_moe(x, w13, w2, ids, wts, top_k, reduce, gated)
    if not fp8 and grouped_mm_usable(x, w13, w2, num_pairs):  # the pairs' rows in expert order, summed later
        pairs = fused_moe_grouped_mm(x, w13, w2, wts.view(num_tokens, top_k), ids.view(num_tokens, top_k),
                                     reduce=False, gated=gated)
        return pairs.reduce().view(num_tokens, hidden).to(x.dtype) if reduce else pairs
    else:
        cfg = next(cfg for limit, cfg in (GROUPED_FP8_CFG if fp8 else GROUPED_CFG) if num_pairs <= limit)
        bm, bn, bk, warps, stages = cfg[:5]
        dbn, dbk, dwarps, dstages = cfg[5:] or cfg[1:5]
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        sorted_pairs, block_expert = align_pairs(ids, num_experts, bm)
        out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
        grid_blocks = block_expert.shape[0]
        _grouped_gate_up_kernel[(grid_blocks, triton.cdiv(inter, bn))](
            x, weight_values(w13), sorted_pairs, block_expert, act, hidden, inter, num_pairs, TOP_K=top_k, BM=bm,
            BN=bn, BK=_bk(bk, w13),
            PREC=prec, GATED=gated, SWAP=fp8 and GROUPED_FP8_SWAP, num_warps=warps, num_stages=stages,
            **fp8_kernel_args(w13))
        _grouped_down_kernel[(grid_blocks, triton.cdiv(hidden, dbn))](
            act, weight_values(w2), sorted_pairs, block_expert, wts, out, hidden, inter, num_pairs, BM=bm, BN=dbn,
            BK=_bk(dbk, w2),
            PREC=prec, SWAP=fp8 and GROUPED_FP8_SWAP, num_warps=dwarps, num_stages=dstages, **fp8_kernel_args(w2))
    out = out.view(num_tokens, top_k, hidden)
    return out.sum(1, dtype=torch.float32).to(x.dtype) if reduce else out


def _bk(bk: int, w) -> int:
    """A K tile for weight ``w``: an FP8 weight's tiles stay inside one column block of scales (BK <= SBK)."""
    return bk if isinstance(w, torch.Tensor) else min(bk, w.block[1])
