"""Acceptance of drafted tokens (the commit of the accepted GDN state is the GDN backend's ``commit_verified``).
All on the device, no host sync.

Per row, the verify pass scores ``[last, d1..dk]``: target distribution ``p_i`` (i = 0..k) is the one for the
token after position i. Emitted tokens are ``e_0..e_a``: the accepted drafts ``d_1..d_a`` and one more token
(the target's own at the first mismatch, or the bonus when all k are accepted). One rule for every row
(``coupled_accept``): e_i is the token plain decoding would emit at that output index (the argmax for greedy rows,
the seeded draw for sampled ones: ``verify_tokens``), and the drafts are accepted while they equal it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core import SamplingBatch
from ..ops.sampling import greedy_tokens, sample


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries are True. mask: [B, k] bool -> [B] int64."""
    return mask.long().cumprod(1).sum(1)


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor):
    """``coupled_accept`` where every row is greedy. drafts: [B, k]; target_logits: [B, k+1, V]."""
    return coupled_accept(drafts, greedy_tokens(target_logits))


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


def per_position(sb: SamplingBatch, positions: int) -> SamplingBatch:
    """A verify's rows as sampling rows, ``positions`` per request: the request's parameters, and the output index
    ``steps + i`` at its position i (what the penalties and the seeded draw key on)."""
    rep = lambda t: t.repeat_interleave(positions)  # noqa: E731
    steps = rep(sb.steps) + torch.arange(positions, device=sb.steps.device).repeat(sb.steps.shape[0])
    return replace(sb, temperatures=rep(sb.temperatures), top_p=rep(sb.top_p), top_k=rep(sb.top_k),
                   seeds=rep(sb.seeds), steps=steps, slots=None if sb.slots is None else rep(sb.slots))


def verify_tokens(logits: torch.Tensor, per_pos: SamplingBatch) -> torch.Tensor:
    """The token plain decoding would emit at each verify position: logits [B, k+1, V] (penalised and masked as
    plain decoding's would be at that index), per_pos from ``per_position``. Returns [B, k+1] int64."""
    batch, width = logits.shape[:2]
    return sample(logits.reshape(batch * width, -1), per_pos).view(batch, width)


def coupled_accept(drafts: torch.Tensor, emitted: torch.Tensor):
    """Speculative decoding that emits exactly plain decoding's tokens: e_i (``emitted``, from ``verify_tokens``)
    is what plain decoding emits at that output index, and the drafts are accepted while they equal it. For a
    sampled row each e_i follows p_i given the tokens before it (the accepted drafts are those tokens), so the
    output distribution is the target's, and more: a seeded request's tokens are the same with or without
    speculation, whichever steps verify and whatever shares them (batch, adaptive policy, preemption). A draft is
    accepted with probability p(d) for a point mass (n-gram), as rejection sampling accepts it; a draft drawn from q
    with that same noise (the MTP head's, ``mtp.MTPDrafter``) matches with a probability a little under rejection
    sampling's sum min(p, q). For a greedy row it is the longest prefix matching the argmax.

    drafts: [B, k]; emitted: [B, k+1]. Returns (emitted, accepted [B])."""
    return emitted, _leading_true(drafts == emitted[:, :-1])
