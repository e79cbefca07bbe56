"""Triton paged attention for fixed-shape passes: decode (1 query per row) and verify / draft extend (S queries
per row, causal among themselves), GQA, any head size.

Split-K ("flash decoding"): the program for (row, KV head, split) attends all G query heads of that KV head for the
row's S queries over its share of the row's keys, and writes a partial result with its log-sum-exp; a second kernel
merges the splits. The number of splits depends only on the batch shape (enough programs to fill the GPU: 128
splits for one row, so a 32k-token context streams through 256 programs instead of 32), never on sequence
lengths: each program reads the row's length on the device and sizes its own share (empty shares exit at once),
and the merge reads only the splits a row's length used. This is what makes the kernels safe to capture in a CUDA
graph and free of host reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import pdl_enter
from .triton_utils import INTERPRET, dot_tile, next_pow2, pdl_launch, sm_count

MIN_SPLITS, MAX_SPLITS = 16, 128
MERGE_CHUNK = 16  # splits merged per step (a [16, D] float32 tile in registers)


@triton.jit
def _attend_block(q, k_ptr, v_ptr, req_to_token_ptr, slot, stride_r2t, stride_kt, stride_kh, kvh, n0, end, q_pos,
                  offs_d, md, m_i, l_i, acc, scale, BN: tl.constexpr, PREC: tl.constexpr):
    """One block of BN keys with online softmax: returns the updated (max, sum, accumulator)."""
    offs_n = n0 + tl.arange(0, BN)
    mn = offs_n < end
    loc = tl.load(req_to_token_ptr + slot * stride_r2t + offs_n, mask=mn, other=0)
    kv_off = loc[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + kv_off, mask=mn[:, None] & md[None, :], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
    keep = mn[None, :] & (offs_n[None, :] <= q_pos[:, None])
    scores = tl.where(keep, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off, mask=mn[:, None] & md[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _paged_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, req_to_token_ptr, req_slots_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_r2t, scale,
    S: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLITS: tl.constexpr, USE_WHILE: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    slot = tl.load(req_slots_ptr + row)
    share = tl.cdiv(tl.cdiv(seq_len, SPLITS), BN) * BN
    start = split * share
    end = tl.minimum(start + share, seq_len)
    # query rows m = s * G + g: token s of the row, head kvh * G + g
    offs_m = tl.arange(0, BM)
    qs = offs_m // G
    qg = offs_m % G
    mm = offs_m < S * G
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    q = tl.load(q_ptr + (row * S + qs)[:, None] * stride_qt + (kvh * G + qg)[:, None] * stride_qh + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    q_pos = seq_len - S + qs  # absolute position of each query
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    if USE_WHILE:  # Triton's interpreter cannot run a for loop with run-time bounds
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, req_to_token_ptr, slot, stride_r2t, stride_kt, stride_kh,
                                          kvh, n0, end, q_pos, offs_d, md, m_i, l_i, acc, scale, BN, PREC)
            n0 += BN
    else:
        for n0 in range(start, end, BN):
            m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, req_to_token_ptr, slot, stride_r2t, stride_kt, stride_kh,
                                          kvh, n0, end, q_pos, offs_d, md, m_i, l_i, acc, scale, BN, PREC)
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    # partials: [B * S, H, SPLITS, D] and [B * S, H, SPLITS]
    tok = row * S + qs
    head = kvh * G + qg
    H = tl.num_programs(1) * G
    base = (tok * H + head) * SPLITS + split
    tl.store(part_o_ptr + base[:, None] * D + offs_d[None, :], out, mask=mm[:, None] & md[None, :])
    tl.store(part_lse_ptr + base, lse, mask=mm)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, gate_ptr, stride_ot, stride_oh, stride_g,
                         H, S: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                         SPLITS: tl.constexpr, CH: tl.constexpr, USE_WHILE: tl.constexpr, GATE: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Per (token, head, block of BD channels): the log-sum-exp weighted sum of the splits the row's length used
    (the split kernel's share rule), CH splits at a time and no further than the used ones (a 1k context uses
    32 of batch 1's 128 splits). At batch 1 the channel blocks give the merge 64 programs instead of 16. With
    GATE, the output gate too: ``out * sigmoid(gate)`` rounded as the unfused torch expression is (the gate row
    read in place from the qkv projection)."""
    pdl_enter(PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + tok // S)
    share = tl.cdiv(tl.cdiv(seq_len, SPLITS), BN) * BN
    used = tl.cdiv(seq_len, tl.maximum(share, 1))
    base = (tok * H + head) * SPLITS
    offs_s = tl.arange(0, SPLITS)
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < used, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.maximum(tl.sum(tl.exp(lse - m), 0), 1e-30)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    md = offs_d < D
    res = tl.zeros([BD], dtype=tl.float32)
    if USE_WHILE:  # Triton's interpreter cannot run a for loop with run-time bounds
        c = 0
        while c < used:
            res += _merge_chunk(part_o_ptr, part_lse_ptr, base, c, used, m, total, offs_d, md, D, CH)
            c += CH
    else:
        for c in range(0, used, CH):
            res += _merge_chunk(part_o_ptr, part_lse_ptr, base, c, used, m, total, offs_d, md, D, CH)
    out = res.to(out_ptr.dtype.element_ty)
    if GATE:
        g = tl.load(gate_ptr + tok * stride_g + head * D + offs_d, mask=md, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) * tl.sigmoid(g).to(out.dtype).to(tl.float32)).to(out.dtype)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out, mask=md)


@triton.jit
def _merge_chunk(part_o_ptr, part_lse_ptr, base, c, used, m, total, offs_d, md, D: tl.constexpr, CH: tl.constexpr):
    """Splits c .. c + CH - 1 (those below ``used``) weighted by their share of the total softmax mass."""
    offs_c = c + tl.arange(0, CH)
    mc = offs_c < used
    w = tl.exp(tl.load(part_lse_ptr + base + offs_c, mask=mc, other=float("-inf")) - m) / total
    o = tl.load(part_o_ptr + (base + offs_c)[:, None] * D + offs_d[None, :], mask=mc[:, None] & md[None, :],
                other=0.0)
    return tl.sum(o * w[:, None], 0)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, stride_k, stride_v, N: tl.constexpr, BN: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Program (token, 0 for the key / 1 for the value): copy its KVH * D row to the token's pool location."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    is_v = tl.program_id(1)
    dst = tl.load(loc_ptr + t).to(tl.int64) * N
    offs = tl.arange(0, BN)
    m = offs < N
    if is_v == 0:
        tl.store(kc_ptr + dst + offs, tl.load(k_ptr + t * stride_k + offs, mask=m), mask=m)
    else:
        tl.store(vc_ptr + dst + offs, tl.load(v_ptr + t * stride_v + offs, mask=m), mask=m)


def store_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> bool:
    """One launch for keys and values; False (nothing written) when a layout is not the expected one (each token's
    [KVH, D] block contiguous, contiguous caches)."""
    tokens, kv_heads, dim = k.shape
    n = kv_heads * dim
    dense_rows = all(x.stride(2) == 1 and x.stride(1) == dim for x in (k, v))
    if not (dense_rows and k_cache.is_contiguous() and v_cache.is_contiguous() and loc.is_contiguous()):
        return False
    if tokens:
        _store_kv_kernel[(tokens, 2)](k, v, k_cache, v_cache, loc, k.stride(0), v.stride(0), N=n, BN=next_pow2(n),
                                      num_warps=4, **pdl_launch(k))
    return True


def num_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Splits of each row's keys: about two programs per SM over the batch's (row, KV head) pairs, a power of two in
    [MIN_SPLITS, MAX_SPLITS]. Depends on the batch shape only (a captured graph fixes it)."""
    sms = sm_count(device)
    want = max(1, 2 * sms // max(1, batch * kv_heads))
    return min(MAX_SPLITS, max(MIN_SPLITS, next_pow2(want)))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                    req_slots: torch.Tensor, seq_lens: torch.Tensor, scaling: float,
                    tokens_per_row: int = 1, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B * S, H, D]; caches: [N, KVH, D]; seq_lens: [B] (the last S positions are the queries); gate: None or
    [B * S, H * D] (rows may be strided) to multiply the output by its sigmoid. Returns [B * S, H, D] in q's
    dtype."""
    num_tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    batch = num_tokens // tokens_per_row
    out = torch.empty_like(q)
    if batch == 0:
        return out
    splits = num_splits(batch, kv_heads, q.device)
    part_o = torch.empty(num_tokens, heads, splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_tokens, heads, splits, dtype=torch.float32, device=q.device)
    bd = dot_tile(dim)  # q . k^T takes the head's channels as its K
    bm = max(16, next_pow2(tokens_per_row * group))
    bn = 32 if bd > 128 else 64
    _paged_attn_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, req_to_token, req_slots, seq_lens, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0), scaling,
        S=tokens_per_row, G=group, D=dim, BD=bd, BM=bm, BN=bn, SPLITS=splits, USE_WHILE=INTERPRET,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, **pdl_launch(q),
    )
    # channel blocks so that a small batch's merge still has a few dozen programs
    mbd = bd if num_tokens * heads >= 64 else max(32, bd // 4)
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    _merge_splits_kernel[(num_tokens, heads, triton.cdiv(dim, mbd))](
        part_o, part_lse, seq_lens, out, gate if gate is not None else out, out.stride(0), out.stride(1),
        gate.stride(0) if gate is not None else 0, heads, S=tokens_per_row, D=dim, BD=mbd, BN=bn, SPLITS=splits,
        CH=min(MERGE_CHUNK, splits), USE_WHILE=INTERPRET, GATE=gate is not None, num_warps=4 if mbd > 64 else 2,
        **pdl_launch(q))
    return out
