"""Triton kernels for Mamba2's decode and verify steps (``ops.mamba2.ssd_decode_ref`` / ``ssd_verify_ref`` in one
launch) and its gated group norm; the prefill's chunked scan is ``ops/mamba2_scan_triton.py``'s. A step's program
holds a [BP, N] block of one head's state of one row in registers across the row's S steps, and for each step computes dt = softplus(dt_raw + dt_bias) (no clamp, as in the reference's steps), the decay
exp(dt * A), the update ``S = S * decay + (dt * x) (outer) B``, and ``y = S C + D x``. Decode writes the state
back to the row's slot; a verify writes each step's state to the verify buffer instead and never the slot. A row
with state slot -1 (padding) starts from zeros and writes nothing but its own verify rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import next_pow2


@triton.jit
def _softplus(v):
    """log(1 + exp(v)), taken as v past 20 (equal there in float32)."""
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))


@triton.jit
def _load_head(row, pool_ptr, slots_ptr, A_log_ptr, D_ptr, dt_bias_ptr, stride_pool, P: tl.constexpr,
               N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    """Row ``row`` of the program's (head, channel block) = program ids 1 and 2: its channels and state indices, the
    row's slot (-1: zeros, nothing written), the [BP, BN] block of the state in float32, and the head's A, D and dt
    bias."""
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mp, mn = offs_p < P, offs_n < N
    m2 = mp[:, None] & mn[None, :]
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0
    addr = pool_ptr + tl.where(valid, slot, 0).to(tl.int64) * stride_pool + h * P * N + offs_p[:, None] * N \
        + offs_n[None, :]
    state = tl.load(addr, mask=m2 & valid, other=0.0).to(tl.float32)
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    return (row, h, offs_p, offs_n, mp, mn, m2, valid, addr, state, A, tl.load(D_ptr + h).to(tl.float32),
            tl.load(dt_bias_ptr + h).to(tl.float32))


@triton.jit
def _mamba2_steps_kernel(x_ptr, dt_ptr, A_log_ptr, D_ptr, dt_bias_ptr, pool_ptr, slots_ptr, y_ptr, verify_ptr,
                         stride_x, stride_dt, stride_pool, stride_vrow, stride_vstep,
                         H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, INNER: tl.constexpr,
                         S: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, VERIFY: tl.constexpr):
    row, h, offs_p, offs_n, mp, mn, m2, valid, addr, state, A, Dh, bias = _load_head(
        tl.program_id(0), pool_ptr, slots_ptr, A_log_ptr, D_ptr, dt_bias_ptr, stride_pool, P, N, BP, BN)
    state_off = h * P * N + offs_p[:, None] * N + offs_n[None, :]
    g = h // (H // G)  # the group whose B and C this head reads
    for s in range(S):
        tok = (row * S + s).to(tl.int64)
        raw = tl.load(dt_ptr + tok * stride_dt + h).to(tl.float32) + bias
        dt = _softplus(raw)
        x = tl.load(x_ptr + tok * stride_x + h * P + offs_p, mask=mp, other=0.0).to(tl.float32)
        Bv = tl.load(x_ptr + tok * stride_x + INNER + g * N + offs_n, mask=mn, other=0.0).to(tl.float32)
        Cv = tl.load(x_ptr + tok * stride_x + INNER + G * N + g * N + offs_n, mask=mn, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(state * Cv[None, :], 1) + Dh * x
        tl.store(y_ptr + (tok * H + h) * P + offs_p, y.to(y_ptr.dtype.element_ty), mask=mp)
        if VERIFY:
            tl.store(verify_ptr + row * stride_vrow + s * stride_vstep + state_off,
                     state.to(verify_ptr.dtype.element_ty), mask=m2)
    if not VERIFY:
        tl.store(addr, state.to(pool_ptr.dtype.element_ty), mask=m2 & valid)


def mamba2_steps(xbc: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                 pool: torch.Tensor, slots: torch.Tensor, num_heads: int, head_dim: int, n_groups: int,
                 state_size: int, steps: int = 1, verify: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """xbc: [B * steps, conv_dim] (the conv's output: x | B | C, unit stride along channels); dt: [B * steps, H]
    raw (unit stride along heads); pool: [slots, H, P, N] (one layer, contiguous per slot); slots: [B];
    verify: None (decode: the slot is updated) or [max_B, steps, H, P, N] (one layer: every step's state, the slot
    untouched). Returns y [B * steps, H, P] in ``out_dtype`` (computed in float32, rounded once at the store: the
    step's rounding to the activations' dtype without a launch of its own)."""
    num_tokens = xbc.shape[0]
    batch = num_tokens // steps
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=out_dtype, device=xbc.device)
    if batch == 0:
        return y
    assert xbc.stride(-1) == 1 and dt.stride(-1) == 1 and pool[0].is_contiguous()
    bp = min(next_pow2(head_dim), 32)
    grid = (batch, num_heads, triton.cdiv(head_dim, bp))
    _mamba2_steps_kernel[grid](
        xbc, dt, A_log, D, dt_bias, pool, slots, y, verify if verify is not None else pool,
        xbc.stride(0), dt.stride(0), pool.stride(0),
        verify.stride(0) if verify is not None else 0, verify.stride(1) if verify is not None else 0,
        H=num_heads, P=head_dim, N=state_size, G=n_groups, INNER=num_heads * head_dim, S=steps, BP=bp,
        BN=next_pow2(state_size), VERIFY=verify is not None, num_warps=4)
    return y


@triton.jit
def _gated_group_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, stride_y, stride_z, stride_out, eps,
                             GS: tl.constexpr, BG: tl.constexpr, GATE_FIRST: tl.constexpr):
    """Token t, group g: ``w * rms_norm(y * silu(z))`` (GATE_FIRST) or ``w * rms_norm(y) * silu(z)`` over the
    group's GS channels, in float32."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * GS + tl.arange(0, BG)
    m = tl.arange(0, BG) < GS
    y = tl.load(y_ptr + t * stride_y + offs, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * stride_z + offs, mask=m, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    h = y * gate if GATE_FIRST else y
    inv = tl.rsqrt(tl.sum(h * h, 0) / GS + eps)
    out = h * inv * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if not GATE_FIRST:
        out = out * gate
    tl.store(out_ptr + t * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def gated_group_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
                     gate_first: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Mamba2's output norm in one pass: y [T, C] (the scan's output), z [T, C] (the gate, rows may be strided: a
    slice of the input projection), weight [C]; the mean of squares per group of C / groups channels. Returns
    [T, C] in ``out_dtype``."""
    tokens, channels = y.shape
    out = torch.empty(tokens, channels, dtype=out_dtype, device=y.device)
    if tokens == 0:
        return out
    assert y.stride(-1) == 1 and z.stride(-1) == 1
    gs = channels // groups
    _gated_group_norm_kernel[(tokens, groups)](y, z, weight, out, y.stride(0), z.stride(0), out.stride(0), eps,
                                               GS=gs, BG=next_pow2(gs), GATE_FIRST=gate_first,
                                               num_warps=4 if gs <= 2048 else 8)
    return out
