"""The routed experts of a large prefill chunk through torch's grouped GEMM (``torch._grouped_mm``: CUTLASS on
Hopper and later), which runs the expert matmuls at tile sizes our Triton grouped kernel cannot hold.

Pairs (token, expert) are sorted by expert on the device, their token rows gathered, and each expert's rows
multiplied by its weights in one launch per projection; the group boundaries are a device tensor, so nothing here
waits for the host. The routing weight scales the activation before the (linear) down projection, and the rows
are put back in pair order, as the Triton paths return them: [T, k, H], for the residual add to sum.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# below this many pairs the Triton grouped kernel (tuned for decode batches, graph-captured) is used
GROUPED_MM_MIN_PAIRS = 4096


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] in (9, 10)


def grouped_mm_usable(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, num_pairs: int) -> bool:
    """Whether this MoE call should run through ``torch._grouped_mm``: many pairs, 16-bit weights, a Hopper or
    Blackwell GPU, and rows whose byte strides keep CUTLASS's 16-byte alignment."""
    if num_pairs < GROUPED_MM_MIN_PAIRS or not x.is_cuda or not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    hidden, inter = x.shape[1], w2.shape[-1]
    return hidden % 8 == 0 and inter % 8 == 0 and _device_supports(x.device.index or 0)


def fused_moe_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_*: [T, k]. Returns the weighted rows of every pair,
    [T, k, H], in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[-1]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)  # pairs grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)  # group g holds sorted rows [ends[g-1], ends[g])
    xs = x.index_select(0, order // top_k)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)  # [P, 2I]
    wts = topk_weights.reshape(-1).index_select(0, order).to(h.dtype)
    act = F.silu(h[:, :inter]) * h[:, inter:] * wts[:, None]
    ys = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)  # [P, H]
    rows = torch.empty_like(ys).index_copy_(0, order, ys)
    return rows.view(num_tokens, top_k, -1)
