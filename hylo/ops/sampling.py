"""Sampling without a host sync: temperature, top-k, top-p, and counter-based noise keyed by (seed, step).

The noise of row b is a hash of (its request's seed, the index of the output token being sampled, the vocabulary
index), so a seeded request samples the same tokens whatever else shares its batch, on any device, after a
preemption too. Sampling is an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` draws from ``p``.
"""

from __future__ import annotations

import torch

from ..core import SamplingBatch
from .triton_utils import use_triton

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply), on int64 tensors holding values < 2^32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def noise_keys(seeds: torch.Tensor, steps: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Each row's noise key, a 32-bit hash of (seed, step, stream) held in int64. [B]."""
    key = _mix32((seeds & _M32) ^ ((seeds >> 32) * 0x9E3779B1 & _M32))
    return _mix32(key ^ ((steps * 0x85EBCA77 + stream * 0xC2B2AE3D) & _M32))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, width: int, stream: int = 0) -> torch.Tensor:
    """Uniform (0, 1) noise of shape [B, width], a pure function of (seed, step, column, stream). On CUDA, for a few
    columns (acceptance tests), one Triton launch computes the same bits."""
    if width <= 64 and use_triton(seeds):
        from .sampling_triton import uniform_noise_triton

        return uniform_noise_triton(seeds, steps, width, stream)
    return uniform_noise_ref(seeds, steps, width, stream)


U_MAX = 1.0 - 2.0 ** -24  # the largest float32 below 1


def uniform_noise_ref(seeds: torch.Tensor, steps: torch.Tensor, width: int, stream: int = 0) -> torch.Tensor:
    """The torch form of :func:`uniform_noise`."""
    cols = torch.arange(width, device=seeds.device, dtype=torch.int64)
    key = noise_keys(seeds, steps, stream)
    x = _mix32((key[:, None] ^ (cols[None, :] * 0x27D4EB2F & _M32)) & _M32)
    x = _mix32(x ^ 0x165667B1) >> 8  # 24 bits, exactly representable in float32
    # (x + 0.5) / 2^24 is never 0; at x = 2^24 - 1 the float32 sum rounds up to 2^24 and u to exactly 1, where the
    # race's -log(u) is 0 and a zero probability divided by it NaN, which the argmax picks: the largest u below 1
    return torch.clamp((x.float() + 0.5) * (1.0 / 16777216.0), max=U_MAX)


def draw(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One token per row from ``probs`` ([B, V]) by the exponential race, with noise keyed by (seed, step, stream).
    On CUDA one Triton pass over the probabilities (``sampling_triton``: the same noise, never materialised)."""
    if use_triton(probs) and probs.stride(-1) == 1:
        from .sampling_triton import draw_triton

        return draw_triton(probs, seeds, steps, stream)
    return draw_ref(probs, seeds, steps, stream)


def draw_ref(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """The torch form of :func:`draw`: the [B, V] noise, then the race."""
    return (probs / -torch.log(uniform_noise_ref(seeds, steps, probs.shape[-1], stream))).argmax(-1)


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k / top-p set and renormalise. probs: [B, V] float32."""
    if top_k is None and top_p is None:
        return probs
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = torch.zeros_like(sorted_p, dtype=torch.bool)
    if top_k is not None:
        drop |= rank >= top_k[:, None]
    if top_p is not None:
        # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does
        # (a row of top_p 1 keeps every token: its float32 running sum may reach 1.0 before the tail's last tokens,
        # and a row's draw must not depend on whether another row of the batch filters)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def sampling_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) with top-k / top-p applied. [B, V] float32."""
    temps = torch.where(sb.temperatures > 0, sb.temperatures, torch.ones_like(sb.temperatures))
    probs = (logits.float() / temps[:, None]).softmax(-1)
    return filter_probs(probs, sb.top_k if sb.need_top_k else None, sb.top_p if sb.need_top_p else None)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` over the last dimension, in one Triton launch on the GPU (``ops.tables_triton``)."""
    if not use_triton(logits) or logits.stride(-1) != 1:
        return logits.argmax(-1)
    from .tables_triton import argmax

    return argmax(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Next token per row ([B] int64): argmax for greedy rows, a seeded draw for the others."""
    greedy = greedy_tokens(logits) if sb.all_greedy or sb.any_greedy else None
    if sb.all_greedy:
        return greedy
    drawn = draw(sampling_probs(logits, sb), sb.seeds, sb.steps)
    if not sb.any_greedy:
        return drawn
    return torch.where(sb.temperatures > 0, drawn, greedy)
