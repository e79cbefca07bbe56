"""Triton kernel for the recurrent gated delta rule over S steps per row (S = 1 decode, S = k + 1 verify).

One program per (row, value head, block of value channels). It fuses everything after the conv: the gating
(``A_log``, ``dt_bias``, softplus, sigmoid beta), the L2 norm and scaling of q and k, and the state update. The
state is read from the pool by slot (-1: zero state, nothing written). The same kernel runs four ways (``MODE``):

- DECODE: one step, the final state back to the slot in place.
- VERIFY_STATES: k + 1 steps, the state after every step to ``verify[row, step]``; the slot is never written
  (the commit then copies the accepted step's state: ``commit_checkpoints``).
- VERIFY_INPUTS: k + 1 steps, outputs only; the step inputs are kept instead of the states (the conv output is
  already in the verify buffer, the raw a and b go to ``ab[token]``); the slot is never written.
- REPLAY: the commit after a VERIFY_INPUTS verify. Every GDN layer in one launch: each row re-runs its accepted
  steps (``accepted[row] + 1``) from its slot's state over the kept inputs, and writes the final state to the slot.
  A float32 state of bench-6b is 2 MB per layer: a verify of k + 1 = 4 steps writing every state moves 4 of them
  per row and layer, and the commit copy 2 more; the replay moves 2 and rereads a few KB of inputs.

(The conv of a decode step inside this kernel, one launch per GDN layer fewer, measured slower on the H200: 1.583
against 1.504 ms per batch-1 step, every value head's program recomputing its key head's q/k conv.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_pdl
from .triton_pdl import pdl_enter
from .triton_utils import env_cfg, next_pow2, pdl_launch

DECODE, VERIFY_STATES, VERIFY_INPUTS, REPLAY = 0, 1, 2, 3
EARLY_LOADS = "gdn" in triton_pdl.EARLY_LOADS  # HYLO_EARLY_LOADS (``triton_pdl``)


@triton.jit
def _delta_step(state, q, k, v, a_in, b_in, A, dt_bias, scale):
    """One step of the gated delta rule on a [BK, BV] block of a value head's state: the gating (softplus of
    ``a + dt_bias`` times ``A = -exp(A_log)``, sigmoid beta), q and k L2-normalised (q scaled), then the update.
    Returns (new state, output block o = S^T q)."""
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
    a = a_in.to(tl.float32) + dt_bias
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    decay = tl.exp(A * softplus)
    beta = tl.sigmoid(b_in.to(tl.float32))
    state = state * decay
    kv = tl.sum(state * k[:, None], axis=0)
    delta = (v - kv) * beta
    state = state + k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


@triton.jit
def _gdn_steps_kernel(
    x_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, pool_ptr, slots_ptr, out_ptr, verify_ptr, acc_ptr,
    stride_x, stride_ab, stride_pool, stride_vrow, stride_vstep, layer_x, layer_ab, layer_pool, scale,
    S: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, MODE: tl.constexpr, EARLY: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """EARLY: the slot, the state and the gates' parameters are loaded before ``pdl_enter`` (none of them is
    written by the kernel before this one: ``triton_pdl.EARLY_LOADS``)."""
    if not EARLY:
        pdl_enter(PDL)
    row = tl.program_id(0)
    layer = (tl.program_id(1) // HV).to(tl.int64)  # REPLAY: every layer in one launch; otherwise 0
    h = tl.program_id(1) % HV
    vb = tl.program_id(2)
    x_ptr += layer * layer_x
    a_ptr += layer * layer_ab
    b_ptr += layer * layer_ab
    pool_ptr += layer * layer_pool
    hk = h // (HV // HK)
    slot = tl.load(slots_ptr + row)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < DK
    mv = offs_v < DV
    m2 = mk[:, None] & mv[None, :]
    state_off = h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    state = tl.load(pool_ptr + safe_slot * stride_pool + state_off, mask=m2 & valid, other=0.0).to(tl.float32)
    A = -tl.exp(tl.load(A_log_ptr + layer * HV + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + layer * HV + h).to(tl.float32)
    if EARLY:
        pdl_enter(PDL)
    last = S - 1
    if MODE == 3:
        last = tl.load(acc_ptr + row)  # the replay runs steps 0..accepted only
    for s in tl.static_range(S):
        if s <= last:
            tok = row * S + s
            xrow = x_ptr + tok * stride_x
            q = tl.load(xrow + hk * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(xrow + HK * DK + hk * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(xrow + 2 * HK * DK + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
            a_in = tl.load(a_ptr + tok * stride_ab + h)
            b_in = tl.load(b_ptr + tok * stride_ab + h)
            state, o = _delta_step(state, q, k, v, a_in, b_in, A, dt_bias, scale)
            if MODE != 3:
                tl.store(out_ptr + tok * (HV * DV) + h * DV + offs_v, o.to(out_ptr.dtype.element_ty), mask=mv)
            if MODE == 1:
                tl.store(verify_ptr + row * stride_vrow + s * stride_vstep + state_off,
                         state.to(verify_ptr.dtype.element_ty), mask=m2)
            if MODE == 2:
                if vb == 0:  # the raw gate inputs, once per (token, head): the replay recomputes decay and beta
                    tl.store(verify_ptr + tok * 2 * HV + h, a_in)
                    tl.store(verify_ptr + tok * 2 * HV + HV + h, b_in)
    if MODE == 0 or MODE == 3:
        tl.store(pool_ptr + safe_slot * stride_pool + state_off, state.to(pool_ptr.dtype.element_ty),
                 mask=m2 & valid)


# (value channels per program, warps) for decode (S = 1), the multi-step verify and the replay, which do up to
# k + 1 steps of arithmetic per state load, by batch size: (up to this many rows, tile). From
# ``tools/tune_kernels.py --only steps`` on the H200 (run -1524, bench-6b shapes, microseconds per layer): decode
# b8 13.1 -> 11.1 with (32, 2), b64 82.6 -> 73.1 with (64, 4); verify (S = 4) b8 21.8 -> 16.2 and b64 112.6 -> 102.3
# with (64, 4) (b1 keeps (32, 4): 7.0 against 8.6); replay b64 83.2 -> 76.5 with (64, 4).
# HYLO_GDN_{DECODE,VERIFY,REPLAY}_CFG replace a table by one tile for every batch size.
_ANY = 1 << 62


def _table(var: str, table: tuple) -> tuple:
    return ((_ANY, env_cfg(var, table[0][1])),) if os.environ.get(var) is not None else table


STEPS_CFG = _table("HYLO_GDN_DECODE_CFG", ((16, (32, 2)), (_ANY, (64, 4))))
MULTI_STEPS_CFG = _table("HYLO_GDN_VERIFY_CFG", ((4, (32, 4)), (_ANY, (64, 4))))
REPLAY_CFG = _table("HYLO_GDN_REPLAY_CFG", ((_ANY, (64, 4)),))


def _tile(table, batch: int) -> tuple[int, int]:
    return next(cfg for limit, cfg in table if batch <= limit)


def gdn_steps(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              pool: torch.Tensor, slots: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
              steps: int = 1, verify: torch.Tensor | None = None, cfg: tuple[int, int] | None = None,
              keep_ab: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B * steps, conv_dim] (conv output: q | k | v); a, b: [B * steps, Hv]; pool: [slots, Hv, Dk, Dv] (one
    layer). Decode with neither ``verify`` nor ``keep_ab``; a verify keeps either every step's state (``verify``:
    [max_B, steps, Hv, Dk, Dv], one layer) or the raw a and b of every token (``keep_ab``: [max_B * steps, 2, Hv],
    one layer; the conv output must then already be in the caller's verify buffer). Returns o [B * steps, Hv, Dv]
    in x's dtype (the layer casts to it next anyway).
    """
    num_tokens = x.shape[0]
    hv = a.shape[-1]
    batch = num_tokens // steps
    out = torch.empty(num_tokens, hv, head_v_dim, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    mode = VERIFY_STATES if verify is not None else VERIFY_INPUTS if keep_ab is not None else DECODE
    if mode == VERIFY_INPUTS:
        assert keep_ab.dtype == a.dtype == b.dtype and keep_ab.shape[1:] == (2, hv) and keep_ab.is_contiguous()
    vbuf = verify if verify is not None else keep_ab if keep_ab is not None else pool
    _launch(x, a, b, A_log, dt_bias, pool, slots, out, vbuf, slots, 1, num_k_heads, head_k_dim, head_v_dim, steps,
            mode, cfg or _tile(STEPS_CFG if steps == 1 else MULTI_STEPS_CFG, batch), (0, 0, 0),
            (vbuf.stride(0), vbuf.stride(1)) if mode == VERIFY_STATES else (0, 0))
    return out


def replay_commit(x: torch.Tensor, ab: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                  slots: torch.Tensor, accepted: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                  steps: int, cfg: tuple[int, int] | None = None) -> None:
    """The commit after VERIFY_INPUTS verifies, every layer at once: each row with slot >= 0 re-runs its first
    ``accepted[row] + 1`` steps from its slot's state and writes the result to the slot.

    x: [L, max_B * steps, conv_dim] and ab: [L, max_B * steps, 2, Hv], the kept inputs (rows in batch order);
    A_log, dt_bias: [L, Hv]; pool: [L, slots, Hv, Dk, Dv]; slots, accepted: [B]."""
    layers, batch, hv = pool.shape[0], slots.shape[0], ab.shape[-1]
    if batch == 0 or layers == 0:
        return
    assert A_log.shape == dt_bias.shape == (layers, hv) and A_log.is_contiguous() and dt_bias.is_contiguous()
    _launch(x[0], ab[0, :, 0], ab[0, :, 1], A_log, dt_bias, pool[0], slots, None, pool, accepted, layers,
            num_k_heads, head_k_dim, head_v_dim, steps, REPLAY, cfg or _tile(REPLAY_CFG, batch),
            (x.stride(0), ab.stride(0), pool.stride(0)),
            (0, 0))


def _launch(x, a, b, A_log, dt_bias, pool, slots, out, vbuf, acc, layers, num_k_heads, head_k_dim, head_v_dim,
            steps, mode, cfg, layer_strides, verify_strides):
    hv = a.shape[-1]
    bv, warps = cfg
    bk, bv = next_pow2(head_k_dim), min(next_pow2(head_v_dim), bv)
    grid = (slots.shape[0], layers * hv, triton.cdiv(head_v_dim, bv))
    _gdn_steps_kernel[grid](
        x, a, b, A_log, dt_bias, pool, slots, out if out is not None else x, vbuf, acc,
        x.stride(0), a.stride(0), pool.stride(0), *verify_strides, *layer_strides, head_k_dim ** -0.5,
        S=steps, HK=num_k_heads, HV=hv, DK=head_k_dim, DV=head_v_dim, BK=bk, BV=bv, MODE=mode,
        EARLY=EARLY_LOADS and mode != REPLAY, num_warps=warps, **pdl_launch(x),
    )


@triton.jit
def _commit_kernel(src_ptr, dst_ptr, slots_ptr, acc_ptr, s_layer, s_row, s_step, d_layer, d_slot, N,
                   BLOCK: tl.constexpr):
    layer = tl.program_id(0).to(tl.int64)  # layer * stride passes 2^31 on real pools
    row = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    a = tl.load(acc_ptr + row)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    m = (offs < N) & (slot >= 0)
    safe = tl.where(slot >= 0, slot, 0)
    v = tl.load(src_ptr + layer * s_layer + row * s_row + a * s_step + offs, mask=m)
    tl.store(dst_ptr + layer * d_layer + safe * d_slot + offs, v.to(dst_ptr.dtype.element_ty), mask=m)


def commit_checkpoints(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor) -> None:
    """dst[:, slots[b]] = src[:, b, accepted[b]] for every row b with slot >= 0, one pass over the bytes.

    src: [L, max_B, S, ...] verify checkpoints; dst: [L, num_slots, ...] the pool (same trailing shape)."""
    layers, batch = src.shape[0], slots.shape[0]
    n = src[0, 0, 0].numel()
    if batch == 0:
        return
    block = 4096
    _commit_kernel[(layers, batch, triton.cdiv(n, block))](
        src, dst, slots, accepted, src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1), n,
        BLOCK=block, num_warps=4)


@triton.jit
def _prefill_gates_kernel(a_ptr, b_ptr, a_out_ptr, beta_ptr, T, H, stride_a, stride_b, BT: tl.constexpr,
                          BH: tl.constexpr):
    """Rows [BT] of the raw gate inputs, strided views of the input projection: a copied contiguous (in its dtype,
    for fla's gate kernel), beta = sigmoid(b) in float32."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BH)
    m = (rows < T)[:, None] & (cols < H)[None, :]
    r = rows.to(tl.int64)[:, None]
    tl.store(a_out_ptr + r * H + cols[None, :], tl.load(a_ptr + r * stride_a + cols[None, :], mask=m), mask=m)
    b = tl.load(b_ptr + r * stride_b + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(beta_ptr + r * H + cols[None, :], 1.0 / (1.0 + tl.exp(-b)), mask=m)


def prefill_gates(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, Hv] with unit column stride (rows may be strided). Returns (a contiguous, sigmoid(b) float32): one
    launch where ``a.contiguous()`` and ``b.float().sigmoid()`` took three, in each GDN layer of a prefill."""
    t, h = a.shape
    a_out = torch.empty(t, h, dtype=a.dtype, device=a.device)
    beta = torch.empty(t, h, dtype=torch.float32, device=a.device)
    if t:
        bh = next_pow2(h)
        bt = max(1, 2048 // bh)
        _prefill_gates_kernel[(triton.cdiv(t, bt),)](a, b, a_out, beta, t, h, a.stride(0), b.stride(0), BT=bt, BH=bh,
                                                     num_warps=4)
    return a_out, beta
