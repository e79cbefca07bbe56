"""Mamba2's selective state space ("SSD") recurrence and its gated norm: plain PyTorch references, in float32.

Per head h (``H`` heads of ``P`` channels, state size ``N``, ``G`` groups of heads sharing B and C):

    dt_t  = softplus(dt_raw_t + dt_bias)            (prefill clamps it to ``dt_limit``; the decode step does not,
                                                     as the released kernels and transformers do)
    S_t   = exp(dt_t * A) * S_{t-1} + dt_t * x_t (outer) B_t       S: [P, N]
    y_t   = S_t C_t + D * x_t

with ``A = -exp(A_log)`` a negative scalar per head. Prefill computes it chunk by chunk (quadratic inside a chunk,
the state carried across chunks), from a slot's state; decode advances a batch one token in place by state slot
(-1: a padded row, which reads zeros and writes nothing); verify runs S tokens per row from given states and keeps
every step's state without writing any (the speculative commit picks one).

The layer around it (``layers/mamba2.py``): an input projection into [z | x B C | dt], a causal depthwise conv with
bias and SiLU over ``x B C`` (``ops.conv1d``), the recurrence, then ``rms_norm(y * silu(z))`` per group of channels
and the output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """softplus(dt + dt_bias) in float32, clamped to ``dt_limit`` where one is given. dt: [..., H]."""
    dt = F.softplus(dt.float() + dt_bias.float())
    if dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H / G)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def ssd_chunk_scan_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor, initial_state: torch.Tensor | None = None, chunk_size: int = 128):
    """One sequence. x: [L, H, P]; dt: [L, H] discretized (``discretize``); A, D: [H]; B, C: [L, G, N];
    initial_state: [H, P, N] or None (zeros). Returns (y [L, H, P] float32, final state [H, P, N] float32).

    Inside a chunk of positions t (and s <= t), with c_t the running sum of dt * A from the chunk's start:
        y_t = exp(c_t) C_t . S_0  +  sum_s exp(c_t - c_s) (C_t . B_s) dt_s x_s  +  D x_t
        S_end = exp(c_last) S_0  +  sum_s exp(c_last - c_s) dt_s x_s (outer) B_s
    """
    length, heads, _ = x.shape
    xf, dtf, Af = x.float(), dt.float(), A.float()
    Bh, Ch = _heads(B.float(), heads), _heads(C.float(), heads)  # [L, H, N]
    state = (torch.zeros(heads, x.shape[-1], B.shape[-1], dtype=torch.float32, device=x.device)
             if initial_state is None else initial_state.float())
    ys = []
    for start in range(0, length, chunk_size):
        sl = slice(start, min(start + chunk_size, length))
        xc, dtc, Bc, Cc = xf[sl], dtf[sl], Bh[sl], Ch[sl]
        cum = torch.cumsum(dtc * Af, 0)  # [l, H]
        n = cum.shape[0]
        # decay from s to t (t >= s), -inf above the diagonal so exp gives 0
        diff = cum[:, None, :] - cum[None, :, :]  # [t, s, H]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
        scores = torch.einsum("thn,shn->tsh", Cc, Bc) * decay  # [t, s, H]
        y = torch.einsum("tsh,shp->thp", scores, xc * dtc[:, :, None])
        y = y + torch.einsum("thn,hpn->thp", Cc, state) * torch.exp(cum)[:, :, None]
        ys.append(y)
        to_end = torch.exp(cum[-1][None, :] - cum)  # [s, H]
        state = state * torch.exp(cum[-1])[:, None, None] + torch.einsum(
            "sh,shp,shn->hpn", to_end * dtc, xc, Bc)
    y = torch.cat(ys) if ys else xf.new_zeros(0, heads, x.shape[-1])
    return y + D.float()[None, :, None] * xf, state


def ssd_step_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor, state: torch.Tensor):
    """One token for a batch. x: [b, H, P]; dt: [b, H] discretized; B, C: [b, G, N]; state: [b, H, P, N].
    Returns (y [b, H, P] float32, new state [b, H, P, N] float32)."""
    heads = x.shape[1]
    xf, dtf = x.float(), dt.float()
    Bh, Ch = _heads(B.float(), heads), _heads(C.float(), heads)  # [b, H, N]
    decay = torch.exp(dtf * A.float())  # [b, H]
    new = state.float() * decay[:, :, None, None] + (dtf[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch) + D.float()[None, :, None] * xf
    return y, new


def ssd_decode_ref(x, dt, A, B, C, D, state_pool: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
    """One token for a batch, in place by slot: state_pool [num_slots, H, P, N] (one layer's), state_slots [b]
    (-1: skipped, reads zeros, writes nothing). Returns y [b, H, P] float32."""
    valid = state_slots >= 0
    idx = state_slots.clamp(min=0)
    prev = state_pool[idx].float() * valid[:, None, None, None]
    y, new = ssd_step_ref(x, dt, A, B, C, D, prev)
    state_pool[idx] = torch.where(valid[:, None, None, None], new.to(state_pool.dtype), state_pool[idx])
    return y


def ssd_verify_ref(x, dt, A, B, C, D, state: torch.Tensor):
    """S tokens per row from the given states, keeping the state after every step (speculative verify).
    x: [b, S, H, P]; dt: [b, S, H]; B, C: [b, S, G, N]; state: [b, H, P, N].
    Returns (y [b, S, H, P] float32, states [b, S, H, P, N] float32)."""
    ys, states = [], []
    cur = state.float()
    for s in range(x.shape[1]):
        y, cur = ssd_step_ref(x[:, s], dt[:, s], A, B[:, s], C[:, s], D, cur)
        ys.append(y)
        states.append(cur)
    return torch.stack(ys, 1), torch.stack(states, 1)


def gate_then_norm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                       eps: float) -> torch.Tensor:
    """``weight * rms_norm(y * silu(z))`` with the mean of squares taken over groups of ``group_size`` channels
    (Mamba2's norm: gate first, then the norm). y, z: [T, C]; returns [T, C] in weight's dtype, the normalized
    product rounded to y's dtype first (as transformers computes it)."""
    h = y.float() * F.silu(z.float())
    g = h.unflatten(-1, (-1, group_size))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.flatten(-2).to(y.dtype)


def norm_then_gate_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                       eps: float) -> torch.Tensor:
    """``weight * rms_norm(y) * silu(z)``, the mean of squares per group of ``group_size`` channels, all in float32,
    then rounded to y's dtype (Falcon-H1's norm with ``mamba_norm_before_gate``)."""
    g = y.float().unflatten(-1, (-1, group_size))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * g.flatten(-2) * F.silu(z.float())).to(y.dtype)
