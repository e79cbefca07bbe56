"""The gated delta rule (Gated DeltaNet's token mixer).

Per value head, with the state ``S`` of shape [Dk, Dv], decay ``gamma_t = exp(g_t)`` and write strength
``beta_t``::

    S_t = gamma_t * S_{t-1} + k_t (beta_t * (v_t - gamma_t * S_{t-1}^T k_t))^T
    o_t = S_t^T q_t

q and k are L2-normalised and q is scaled by ``Dk ** -0.5``. Key heads are shared by ``Hv / Hk`` consecutive value
heads. Everything is computed in float32 whatever the input dtype; states are float32 unless the pool says
otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor):
    """Log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, both float32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def _prepare(q, k, v, num_v_heads):
    rep = num_v_heads // q.shape[-2]
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    return q, k, v.float()


def chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """Prefill over one sequence in chunks (the WY form of the recurrence).

    q, k: [L, Hk, Dk]; v: [L, Hv, Dv]; g, beta: [L, Hv] (float32); initial_state: [Hv, Dk, Dv] or None (zeros).
    Returns (o [L, Hv, Dv] float32, final state [Hv, Dk, Dv] float32).

    Within a chunk with cumulative log-decay G (from the chunk start) and chunk-initial state S0, the deltas
    U = T (beta V) - T (beta e^G K) S0 with T = (I + A)^-1, A[s, r] = beta_s e^(G_s - G_r) k_s.k_r (r < s);
    then O = e^G Q S0 + (QK^T * e^(G_t - G_s), s <= t) U and S = e^(G_C) S0 + (K e^(G_C - G))^T U.
    """
    length = q.shape[0]
    num_v_heads, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    q, k, v = _prepare(q, k, v, num_v_heads)
    # head-major: [H, L, D]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.float().t(), beta.float().t()  # [H, L]
    state = (q.new_zeros(num_v_heads, dk, dv) if initial_state is None else initial_state.float().clone())
    out = torch.empty(num_v_heads, length, dv, dtype=torch.float32, device=q.device)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        c = end - start
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        bc = beta[:, start:end]
        G = g[:, start:end].cumsum(-1)  # [H, c]
        diff = G[:, :, None] - G[:, None, :]  # [H, c, c], G_t - G_s
        lower_incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower_incl, diff, torch.full_like(diff, float("-inf"))).exp()
        kk = kc @ kc.transpose(-1, -2)
        A = (bc[:, :, None] * kk * decay).tril(-1)
        eye = torch.eye(c, dtype=torch.float32, device=q.device)
        rhs = torch.cat([bc[..., None] * vc, (bc * G.exp())[..., None] * kc], dim=-1)
        sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        u = sol[..., :dv] - sol[..., dv:] @ state  # [H, c, Dv]
        attn = (qc @ kc.transpose(-1, -2)) * decay
        out[:, start:end] = (G.exp()[..., None] * qc) @ state + attn @ u
        G_end = G[:, -1:]
        state = G_end.exp()[..., None] * state + ((G_end - G).exp()[..., None] * kc).transpose(-1, -2) @ u
    return out.transpose(0, 1), state


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, state):
    """One step for a batch of rows, all in registers of the caller (no slot logic).

    q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state: [B, Hv, Dk, Dv] float32.
    Returns (o [B, Hv, Dv] float32, new state [B, Hv, Dk, Dv] float32).
    """
    q, k, v = _prepare(q, k, v, v.shape[-2])
    state = state.float() * g.float().exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(-2)  # [B, H, Dv]
    delta = (v - kv_mem) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(-2)
    return out, state


def gdn_decode_ref(q, k, v, g, beta, state_pool, state_slots):
    """One decode step reading and writing the recurrent state in place by slot (-1 = skip).

    state_pool: [num_slots, Hv, Dk, Dv] (one layer's pool). Returns o [B, Hv, Dv] float32.
    """
    valid = state_slots >= 0
    idx = state_slots.clamp(min=0)
    state = state_pool[idx].float() * valid[:, None, None, None]
    out, new = recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    # NOTE: skipped rows write back slot 0's own contents (slot 0 is reserved), so nothing changes for them.
    state_pool[idx] = torch.where(valid[:, None, None, None], new.to(state_pool.dtype), state_pool[idx])
    return out


def gdn_verify_ref(q, k, v, g, beta, state):
    """S steps for a batch from the given states, keeping the state after every step (for speculative verify).

    q, k: [B, S, Hk, Dk]; v: [B, S, Hv, Dv]; g, beta: [B, S, Hv]; state: [B, Hv, Dk, Dv].
    Returns (o [B, S, Hv, Dv] float32, states [B, S, Hv, Dk, Dv] float32).
    """
    outs, states = [], []
    cur = state.float()
    for s in range(q.shape[1]):
        o, cur = recurrent_gated_delta_rule_ref(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], cur)
        outs.append(o)
        states.append(cur)
    return torch.stack(outs, 1), torch.stack(states, 1)
