"""Acceptance of drafted tokens (the commit of the accepted GDN state is the GDN backend's ``commit_verified``).
All on the device, no host sync.

Per row, the verify pass scores ``[last, d1..dk]``: target distribution ``p_i`` (i = 0..k) is the one for the
token after position i. Emitted tokens are ``e_0..e_a``: the accepted drafts ``d_1..d_a`` and one more token
(the target's own at the first mismatch, or the bonus when all k are accepted). Greedy rows take the argmax,
sampled rows the draw plain decoding would make at that output index (``coupled_accept``).
"""

from __future__ import annotations

import torch

from ..ops.sampling import draw, greedy_tokens


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


def coupled_accept(drafts: torch.Tensor, target_probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor):
    """Speculative sampling that emits exactly plain decoding's tokens: e_i is the draw from p_i with the noise plain
    sampling keys by the same (seed, output index), and the drafts are accepted while they equal it. Each e_i
    follows p_i given the tokens before it (the accepted drafts are those tokens), so the output distribution is the
    target's, and more: a seeded request's tokens are the same with or without speculation, whichever steps verify
    and whatever shares them (batch, adaptive policy, preemption). A draft is accepted with probability p(d) for a
    point mass (n-gram), as rejection sampling accepts it; a draft drawn from q with that same noise (the MTP
    head's, ``mtp.MTPDrafter``) matches with a probability a little under rejection sampling's sum min(p, q).

    drafts: [B, k]; target_probs: [B, k+1, V]; seeds/steps: [B] (steps = the output index of e_0). Returns
    (emitted [B, k+1], accepted [B])."""
    batch, k = drafts.shape
    index = (steps[:, None] + torch.arange(k + 1, device=drafts.device)).reshape(-1)
    emitted = draw(target_probs.reshape(batch * (k + 1), -1), seeds[:, None].expand(batch, k + 1).reshape(-1),
                   index).view(batch, k + 1)
    return emitted, _leading_true(drafts == emitted[:, :k])
