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


def accept_limit(emitted: torch.Tensor, fed: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                 sampling_i: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """The most drafts each verify row may accept [B], so that nothing is computed past its request's end: its
    max_tokens (the tokens it already emitted are ``seq_lens - k - prompt length``) and, unless the request ignores
    them, the first end-of-sequence token among the accepted ones (which is then its last emitted token). -1 marks
    a row whose request had ended before this step (launched before the host knew: the overlap loop runs a step
    ahead): it commits nothing at all (``inert_rows``). So a request's state holds exactly the tokens it returned,
    which the prefix cache keeps for its next turn. emitted: [B, k + 1], the tokens a full acceptance would emit;
    fed: [B], each row's first fed token (its newest); sampling_i: the request table (``ReqSlots.sampling_i``)."""
    k = emitted.shape[1] - 1
    row = sampling_i[req_slots]
    done = seq_lens - k - row[:, 2]  # output tokens before this step
    limit = (row[:, 3] - done - 1).clamp(min=-1, max=k)
    if eos.numel():
        stops = row[:, 4] > 0
        is_eos = torch.isin(emitted[:, :k], eos) & stops[:, None]
        first = torch.where(is_eos.any(1), is_eos.to(torch.int64).argmax(1), torch.full_like(limit, k))
        limit = torch.where(torch.isin(fed, eos) & stops, torch.full_like(limit, -1), torch.minimum(limit, first))
    return limit


def inert_rows(state_slots: torch.Tensor, accepted: torch.Tensor):
    """The commit's view of a verify whose rows may be inert (accepted -1, see ``accept_limit``): their state slot
    becomes -1 (skipped) and their accepted count 0. Returns (state slots, accepted counts) for the commit."""
    inert = accepted < 0
    return torch.where(inert, torch.full_like(state_slots, -1), state_slots), accepted.clamp(min=0)


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
