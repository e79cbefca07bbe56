"""The Triton form of ``SortedPairRows.reduce`` (``ops.pair_rows``): each token's weighted sum of its k rows,
gathered from the expert-sorted order in one read (the un-sort and the reduction together)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_sum_kernel(ys_ptr, pos_ptr, wts_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, BH: tl.constexpr):
    """Program (token, block of BH outputs): sum over the token's pairs j of weight_j * ys[pos_j] in float32, where
    pos_j is pair j's row in the expert-sorted order."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    m = offs < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pos_ptr + t * TOP_K + j).to(tl.int64)
        w = tl.load(wts_ptr + t * TOP_K + j).to(tl.float32)
        acc += w * tl.load(ys_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + offs, acc, mask=m)



def gather_sum(ys: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's weighted sum of its top_k rows of ys (pair j of token t at row pos[t * top_k + j]), [T, 1, H]
    float32 (:meth:`ops.pair_rows.SortedPairRows.reduce`)."""
    num_tokens, hidden = pos.numel() // top_k, ys.shape[1]
    out = torch.empty(num_tokens, 1, hidden, dtype=torch.float32, device=ys.device)
    if num_tokens:
        bh = min(1024, triton.next_power_of_2(hidden))
        _gather_sum_kernel[(num_tokens, triton.cdiv(hidden, bh))](ys, pos, weights, out, hidden, TOP_K=top_k, BH=bh,
                                                                  num_warps=4)
    return out
