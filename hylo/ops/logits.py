"""What happens to the logits around sampling: the request's changes before it (logit bias, min_tokens,
repetition / frequency / presence penalties, from the per-slot tables of ``cache.penalty_tables``), and the log
probabilities reported to the client after it (from the raw logits). Plain torch on every device: these run only for
the rows that ask for them, outside the captured graphs."""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, tables, slots: torch.Tensor, out_index: torch.Tensor,
                    extra: torch.Tensor | None = None) -> torch.Tensor:
    """The sampled-from logits of rows ``slots`` [B] (float32 [B, V]): ``out_index`` [B] is the index of the
    output token each row samples (min_tokens masks the stop tokens while it is below it); ``extra`` [B, V] counts
    output tokens the tables do not hold yet (a verify position's drafts before it)."""
    x = logits.float() + tables.bias[slots]
    masked = tables.stop_mask[slots] & (out_index < tables.min_tokens[slots])[:, None]
    x = x.masked_fill(masked, float("-inf"))
    counts = tables.out_counts[slots].float()
    if extra is not None:
        counts = counts + extra
    presence, frequency, repetition = tables.params[slots].unbind(-1)
    seen = (counts > 0) | tables.in_prompt[slots]
    rep = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()


def verify_extra_counts(drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """For a verify of k drafts per row [B, k]: position i's extra output counts are drafts 1..i, the tokens fed
    before it in this step. Returns [B, k + 1, V] float32 (position 0 has none)."""
    rows, k = drafts.shape
    onehot = torch.zeros(rows, k + 1, vocab, dtype=torch.float32, device=drafts.device)
    onehot[:, 1:].scatter_(2, drafts[:, :, None], 1.0)
    return onehot.cumsum(1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[torch.Tensor, ...]:
    """log_softmax of the raw logits [B, V] in float32: the chosen tokens' [B] and, with ``top_n``, the top_n
    most likely ids [B, top_n] and their log probabilities [B, top_n]."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(-1, tokens.reshape(-1, 1).to(torch.int64))[:, 0]
    if top_n:
        vals, ids = lp.topk(top_n, dim=-1)
        return chosen, ids, vals
    empty = torch.empty(lp.shape[0], 0, device=lp.device)
    return chosen, empty.long(), empty
