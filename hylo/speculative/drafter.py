"""What a drafter is to the speculative worker (``worker.SpecWorker``): it keeps ``drafts[req_slot]``, the k
drafts each request's next verify checks, and follows every step the target runs (``after_prefill``,
``after_decode``, ``after_verify``). The other hooks are capabilities, whose defaults here say "none"."""

from __future__ import annotations

import torch

from ..core import ForwardBatch


class Drafter:
    drafts: torch.Tensor  # [max_num_seqs + 1, k]: each request slot's drafts for its next verify
    # draft_greedy: the drafter runs inside the captured greedy verify step (all on the device)
    fused_greedy = False

    def after_prefill(self, worker, batch: ForwardBatch, hidden, next_ids, tok_idx, row_idx, sb,
                      max_seq_len: int) -> None:
        """After a prefill step: the rows ``row_idx`` that sampled (their last token at ``tok_idx``) draft."""
        raise NotImplementedError

    def after_decode(self, worker, batch: ForwardBatch, hidden, tokens, sb, draft: bool, fused: bool = False) -> None:
        """After a plain step (one token per row): keep up, and draft for the next step when ``draft``."""
        raise NotImplementedError

    def after_verify(self, worker, batch: ForwardBatch, hidden, emitted, accepted, sb) -> None:
        raise NotImplementedError

    def draft_greedy(self, worker, batch: ForwardBatch, hidden, accepted) -> None:
        """The next drafts inside the fused greedy step (``fused_greedy``)."""
        raise NotImplementedError

    def graph_fn(self, backend):
        """The drafter's own pass, captured as the DRAFT_EXTEND / DRAFT_DECODE graphs; None: it has none."""
        return None

    def fill_history(self, hits) -> None:
        """Prefix-cache hits ((req, length) pairs), whose cached tokens were never fed: for a drafter that keeps
        the tokens it has seen."""

    def draft_limit(self, req_slots: torch.Tensor) -> torch.Tensor | None:
        """The most drafts each row's verify may accept [B] (a drafter that drafted nothing for some rows); None:
        all k."""
        return None
