"""Triton attention for prefill chunks over the paged KV pool: every row of a step in one launch, each row's queries
attending to its cached prefix and causally to themselves.

Why not torch's fused attention row by row (what the prefill path did before): a row with a cached prefix needs a
mask (its queries sit at the end of its keys), the mask picks cuDNN, and cuDNN builds an execution plan for every
new pair of lengths on the host, about 3 ms a call. A step that carries decoding rows beside a prefill chunk, or a
prefix-cache hit, met it once per row and attention layer: on bench-6b (H100) such steps took 1.2 s. Here the
lengths are data: one host table of (row, first query) per block of queries, one copy, one launch per layer.

A program handles one block of ``BT`` queries of one row for one query head and streams the row's keys, up to its
block's last query, through the paged-attention kernel's online-softmax step (``_attend_block``). Fresh prompts
long enough for the fused kernels to pay off (no prefix, ``SDPA_MIN_TOKENS`` queries or more) still go to torch's
attention; the others come here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_triton import _attend_block
from .triton_utils import INTERPRET, dot_tile

# A fresh prompt (no cached prefix) of at least this many tokens goes to torch's fused attention (flash or cuDNN,
# whose causal kernel needs no mask); shorter ones, and every row with a prefix, are batched here.
SDPA_MIN_TOKENS = 512


def block_tokens(dim: int) -> int:
    """Queries per program (the q tile [BT, D] and the float32 accumulator stay in registers)."""
    return 64 if dim <= 128 else 32


def query_blocks(rows: list[int], extend_lens: list[int], bt: int) -> torch.Tensor:
    """Host int32 [NB, 2]: (row, first query within the row) of every block of ``bt`` queries of ``rows``."""
    flat = [v for r in rows for t0 in range(0, extend_lens[r], bt) for v in (r, t0)]
    return torch.tensor(flat, dtype=torch.int32).view(-1, 2)


@triton.jit
def _extend_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, req_to_token_ptr, req_slots_ptr, seq_lens_ptr, qsl_ptr,
                        blocks_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_r2t,
                        scale, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
                        BN: tl.constexpr, USE_WHILE: tl.constexpr, PREC: tl.constexpr):
    blk = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(blocks_ptr + 2 * blk)
    t0 = tl.load(blocks_ptr + 2 * blk + 1)
    first = tl.load(qsl_ptr + row)
    length = (tl.load(qsl_ptr + row + 1) - first).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    slot = tl.load(req_slots_ptr + row)
    prefix = seq_len - length
    offs_t = t0 + tl.arange(0, BT)
    mt = offs_t < length
    offs_d = tl.arange(0, BD)
    md = offs_d < D
    tok = first + offs_t
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mt[:, None] & md[None, :], other=0.0)
    q_pos = prefix + offs_t  # absolute position of each query (key n is visible to it when n <= q_pos)
    end = prefix + tl.minimum(t0 + BT, length)  # keys the block's last query sees
    kvh = head // G
    m_i = tl.full([BT], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BT], dtype=tl.float32)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    if USE_WHILE:  # Triton's interpreter cannot run a for loop with run-time bounds
        n0 = 0
        while n0 < end:
            m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, req_to_token_ptr, slot, stride_r2t, stride_kt, stride_kh,
                                          kvh, n0, end, q_pos, offs_d, md, m_i, l_i, acc, scale, BN, PREC)
            n0 += BN
    else:
        for n0 in range(0, end, BN):
            m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, req_to_token_ptr, slot, stride_r2t, stride_kt, stride_kh,
                                          kvh, n0, end, q_pos, offs_d, md, m_i, l_i, acc, scale, BN, PREC)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mt[:, None] & md[None, :])


def extend_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                            req_slots: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            blocks: torch.Tensor, out: torch.Tensor, scaling: float) -> None:
    """Writes into ``out`` ([T, H, D]) the attention of the query blocks ``blocks`` (device int32 [NB, 2], from
    :func:`query_blocks` with :func:`block_tokens`); q: [T, H, D] packed by row (``query_start_loc`` [B + 1]); the
    rows' new keys and values are in the caches already; ``seq_lens`` [B]: prefix + new tokens per row."""
    num_blocks = blocks.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    if num_blocks == 0:
        return
    if q.stride(-1) != 1:  # the kernel reads each head's channels as one contiguous run
        q = q.contiguous()
    bt = block_tokens(dim)
    _extend_attn_kernel[(num_blocks, heads)](
        q, k_cache, v_cache, out, req_to_token, req_slots, seq_lens, query_start_loc, blocks,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        req_to_token.stride(0), scaling, G=heads // k_cache.shape[1], D=dim, BD=dot_tile(dim), BT=bt,
        BN=32 if dim > 128 else 64, USE_WHILE=INTERPRET, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if dim <= 128 else 8)
