"""Depthwise causal conv1d with SiLU (and an optional per-channel bias: Mamba2's), continuing from a per-request
conv state.

The conv state of a request holds the last ``K - 1`` inputs, channel-major: ``[conv_dim, K - 1]``. A state slot
of -1 marks a padded row: it reads zeros and writes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float()


def causal_conv1d_ref(x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor,
                      bias: torch.Tensor | None = None):
    """Prefill over one sequence.

    x: [L, C] new inputs; conv_state: [C, K-1] the previous inputs (None = zeros); weight: [C, K].
    Returns (out [L, C] in x's dtype, new_state [C, K-1] in float32).
    """
    length, channels = x.shape
    k = weight.shape[-1]
    prev = x.new_zeros(channels, k - 1, dtype=torch.float32) if conv_state is None else conv_state.float()
    full = torch.cat([prev, x.float().t()], dim=1)  # [C, K-1+L]
    out = F.conv1d(full.unsqueeze(0), weight.float().unsqueeze(1), _bias(bias), groups=channels)[0]  # [C, L]
    out = F.silu(out).t().to(x.dtype)
    return out, full[:, -(k - 1):]


def causal_conv1d_update_ref(x: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor,
                             state_slots: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step for a batch, reading and writing the conv states in place by slot.

    x: [B, C]; conv_pool: [num_slots, C, K-1] (one layer's pool); weight: [C, K]; state_slots: [B] (-1 = skip).
    """
    valid = state_slots >= 0
    idx = state_slots.clamp(min=0)
    prev = conv_pool[idx].float() * valid[:, None, None]  # [B, C, K-1]
    window = torch.cat([prev, x.float().unsqueeze(-1)], dim=-1)  # [B, C, K]
    pre = (window * weight.float()).sum(-1)
    out = F.silu(pre if bias is None else pre + bias.float()).to(x.dtype)
    new = window[:, :, 1:].to(conv_pool.dtype)
    # NOTE: skipped rows write back the current contents of slot 0 (reserved, never a real request's slot).
    conv_pool[idx] = torch.where(valid[:, None, None], new, conv_pool[idx])
    return out


def causal_conv1d_windows_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None = None):
    """Several steps for a batch without writing any state: returns every step's window (for verify).

    x: [B, S, C]; conv_state: [B, C, K-1]. Returns (out [B, S, C], states [B, S, C, K-1]) where states[:, s] is the
    conv state after step s.
    """
    batch, steps, channels = x.shape
    k = weight.shape[-1]
    full = torch.cat([conv_state.float(), x.float().transpose(1, 2)], dim=2)  # [B, C, K-1+S]
    windows = full.unfold(2, k, 1)  # [B, C, S, K]
    pre = (windows * weight.float()[:, None, :]).sum(-1)  # [B, C, S]
    out = F.silu(pre if bias is None else pre + bias.float()[:, None]).transpose(1, 2).to(x.dtype)
    states = windows[..., 1:].permute(0, 2, 1, 3)  # [B, S, C, K-1]
    return out, states
