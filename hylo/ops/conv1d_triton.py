"""Triton kernel for the causal depthwise conv1d + SiLU over S steps per row (S = 1 decode, S = k + 1 verify).

One program per (row, block of channels). The window of step s is ``[state[s:], x[:s + 1]]``: every element is
loaded from where it lives (the slot's conv state or the new inputs), so nothing needs shifting in registers.
Decode writes the new window back to the slot (-1: zero state, nothing written); verify writes the window after
every step to ``verify[row, step]`` and never the slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_steps_kernel(
    x_ptr, w_ptr, pool_ptr, slots_ptr, out_ptr, verify_ptr,
    stride_x, stride_out, stride_pool, stride_vrow, stride_vstep, C,
    S: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, VERIFY: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = offs < C
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    state_base = pool_ptr + safe_slot * stride_pool + offs * (K - 1)  # state[c, j] at state_base + j
    for s in tl.static_range(S):
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(K):
            idx = j + s  # position in [state (K-1) | x (S)]
            if idx < K - 1:
                val = tl.load(state_base + idx, mask=mc & valid, other=0.0).to(tl.float32)
            else:
                val = tl.load(x_ptr + (row * S + idx - (K - 1)) * stride_x + offs, mask=mc, other=0.0).to(tl.float32)
            acc += val * tl.load(w_ptr + offs * K + j, mask=mc, other=0.0).to(tl.float32)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (row * S + s) * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mc)
        if VERIFY:
            for j in tl.static_range(K - 1):
                vidx = j + s + 1
                if vidx < K - 1:
                    wv = tl.load(state_base + vidx, mask=mc & valid, other=0.0).to(tl.float32)
                else:
                    wv = tl.load(x_ptr + (row * S + vidx - (K - 1)) * stride_x + offs, mask=mc,
                                 other=0.0).to(tl.float32)
                tl.store(verify_ptr + row * stride_vrow + s * stride_vstep + offs * (K - 1) + j,
                         wv.to(verify_ptr.dtype.element_ty), mask=mc)
    if not VERIFY:
        # the new window is the last K-1 of [state | x]. In increasing j, element j reads index j + S > j, which
        # no earlier iteration has overwritten, so the shift can be done in place.
        for j in tl.static_range(K - 1):
            sidx = j + S
            if sidx < K - 1:
                sv = tl.load(state_base + sidx, mask=mc & valid, other=0.0).to(tl.float32)
            else:
                sv = tl.load(x_ptr + (row * S + sidx - (K - 1)) * stride_x + offs, mask=mc, other=0.0).to(tl.float32)
            tl.store(state_base + j, sv.to(pool_ptr.dtype.element_ty), mask=mc & valid)


def conv_steps(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, steps: int = 1,
               verify: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B * steps, C] (may be a strided view); weight: [C, K]; pool: [slots, C, K-1] (one layer);
    verify: [max_B, steps, C, K-1] (one layer) or None. Returns silu(conv) [B * steps, C] in x's dtype."""
    num_tokens, channels = x.shape
    k = weight.shape[-1]
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    batch = num_tokens // steps
    if batch == 0:
        return out
    bc = 256
    vbuf = verify if verify is not None else pool
    _conv_steps_kernel[(batch, triton.cdiv(channels, bc))](
        x, weight, pool, slots, out, vbuf,
        x.stride(0), out.stride(0), pool.stride(0),
        vbuf.stride(0) if verify is not None else 0, vbuf.stride(1) if verify is not None else 0, channels,
        S=steps, K=k, BC=bc, VERIFY=verify is not None, num_warps=4,
    )
    return out
