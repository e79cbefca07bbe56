"""Acceptance of drafted tokens (the commit of the accepted GDN state is the GDN backend's ``commit_verified``).
All on the device, no host sync.

Per row, the verify pass scores ``[last, d1..dk]``: target distribution ``p_i`` (i = 0..k) is the one for the
token after position i. Emitted tokens are ``e_0..e_a``: the accepted drafts ``d_1..d_a`` and one more token
(the correction at the first rejection, or the bonus when all k are accepted).
"""

from __future__ import annotations

import torch

from ..ops.sampling import draw, greedy_tokens, uniform_noise

STREAM_ACCEPT = 1  # noise streams (see ops/sampling.uniform_noise): acceptance tests
STREAM_RESAMPLE = 3  # the correction / bonus draw


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries are True. mask: [B, k] bool -> [B] int64."""
    return mask.long().cumprod(1).sum(1)


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor):
    """drafts: [B, k]; target_logits: [B, k+1, V]. Returns (emitted [B, k+1], accepted [B]): the longest prefix
    matching the target's argmax, and the target's argmax after it (which equals the drafts before it)."""
    best = greedy_tokens(target_logits)
    return best, _leading_true(drafts == best[:, :-1])


def rejection_accept(drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     seeds: torch.Tensor, steps: torch.Tensor):
    """Speculative sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection draw from
    normalize(max(p - q, 0)); when all are accepted draw the bonus from p_k. ``draft_probs`` None means each draft
    is a point mass (n-gram drafts). The output distribution is exactly the target's.

    drafts: [B, k]; draft_probs: [B, k, V] or None; target_probs: [B, k+1, V]; seeds/steps: [B] key the noise
    (steps = index of the first output token this verify emits). Returns (emitted [B, k+1], accepted [B]).
    """
    batch, k = drafts.shape
    vocab = target_probs.shape[-1]
    p_d = target_probs[:, :k].gather(-1, drafts[..., None])[..., 0]  # [B, k]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, drafts[..., None])[..., 0]
    # the acceptance noise of draft i is keyed by step steps + i: all k at once (one hash, not k)
    offsets = torch.arange(k, device=drafts.device)
    u = uniform_noise(seeds[:, None].expand(batch, k).reshape(-1), (steps[:, None] + offsets).reshape(-1), 1,
                      STREAM_ACCEPT).view(batch, k)
    accepted = _leading_true(u * q_d < p_d)
    rows = torch.arange(batch, device=drafts.device)
    p_a = target_probs[rows, accepted]  # [B, V]
    if draft_probs is None:
        q_a = torch.nn.functional.one_hot(drafts.gather(1, accepted.clamp(max=k - 1)[:, None])[:, 0], vocab).float()
    else:
        q_a = draft_probs[rows, accepted.clamp(max=k - 1)]
    q_a = torch.where((accepted < k)[:, None], q_a, torch.zeros_like(q_a))  # all accepted: the bonus draws from p_k
    residual = (p_a - q_a).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_a)
    extra = draw(residual, seeds, steps + accepted, STREAM_RESAMPLE)
    emitted = torch.cat([drafts, drafts[:, :1]], dim=1).clone()
    emitted[rows, accepted] = extra
    return emitted, accepted
