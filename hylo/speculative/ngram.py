"""n-gram drafter (prompt lookup): propose the k tokens that followed the latest earlier occurrence of the request's
last n tokens (n from 4 down to 1), searched on the device over a device-resident token history. No host sync:
every shape comes from host-side upper bounds. A row without any match drafts nothing: its verify row accepts none
of the filler it carries (its last token repeated) and emits the target's one token, as a plain row would."""

from __future__ import annotations

import torch

from ..core import ForwardBatch, SamplingBatch, to_device
from .drafter import Drafter


class NgramDrafter(Drafter):

    def __init__(self, k: int, max_num_seqs: int, max_context: int, device: torch.device, max_n: int = 4,
                 min_n: int = 1):
        self.k, self.max_n, self.min_n = k, max_n, min_n
        self.table = torch.zeros(max_num_seqs + 1, max_context, dtype=torch.int64, device=device)
        self.lens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
        self.drafts = torch.zeros(max_num_seqs + 1, k, dtype=torch.int64, device=device)
        self.draft_lens = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)  # k, or 0: no match

    def propose(self, hist: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hist: [B, L] token history (valid up to lens); lens: [B]. Returns drafts [B, k] and whether each row
        found a match [B]."""
        batch, width = hist.shape
        ar = torch.arange(width, device=hist.device)
        found = torch.full((batch,), -1, dtype=torch.int64, device=hist.device)
        for n in range(self.max_n, self.min_n - 1, -1):
            if width < n + 1:
                continue
            suffix = hist.gather(1, (lens[:, None] - n + ar[None, :n]).clamp(min=0))  # [B, n]
            windows = hist.unfold(1, n, 1)  # [B, L - n + 1, n]
            starts = ar[: width - n + 1]
            # a match must end before the last token, so at least one token follows it
            ok = (windows == suffix[:, None, :]).all(-1) & (starts[None, :] + n <= lens[:, None] - 1)
            ok &= (lens >= n + 1)[:, None]
            latest = torch.where(ok, starts[None, :], torch.full_like(ok, -1, dtype=torch.int64)).max(1).values
            found = torch.where((found < 0) & (latest >= 0), latest + n, found)
        last = (lens - 1).clamp(min=0)
        start = torch.where(found >= 0, found, last)
        idx = torch.minimum(start[:, None] + torch.arange(self.k, device=hist.device)[None, :], last[:, None])
        return hist.gather(1, idx), found >= 0

    def _propose_for(self, req_slots: torch.Tensor, max_len: int) -> None:
        width = min(max_len, self.table.shape[1])
        drafts, matched = self.propose(self.table[req_slots, :width], self.lens[req_slots])
        self.drafts[req_slots] = drafts
        self.draft_lens[req_slots] = matched.long() * self.k

    def draft_limit(self, req_slots: torch.Tensor) -> torch.Tensor:
        """The most drafts each row's verify may accept [B]: k, or 0 where the lookup found no match."""
        return self.draft_lens[req_slots]

    def fill_history(self, hits) -> None:
        """Requests that reuse a cached prefix ((req, length) pairs) never feed its tokens: write them into their
        history rows here (one copy), so that their drafts are what they would be without the cache."""
        rows = torch.cat([torch.full((m,), req.req_slot, dtype=torch.int64) for req, m in hits])
        cols = torch.cat([torch.arange(m, dtype=torch.int64) for _, m in hits])
        vals = torch.cat([req.token_tensor(0, m) for req, m in hits])
        packed = to_device(torch.stack([rows, cols, vals]), self.table.device)
        self.table[packed[0], packed[1]] = packed[2]

    def after_prefill(self, worker, batch: ForwardBatch, hidden, next_ids: torch.Tensor, tok_idx: torch.Tensor,
                      row_idx: torch.Tensor, sb: SamplingBatch, max_seq_len: int) -> None:
        tok_slots = torch.repeat_interleave(batch.req_slots, batch.query_start_loc.diff(),
                                            output_size=batch.num_tokens)
        self.table[tok_slots, batch.positions] = batch.input_ids
        if tok_idx.numel() == 0:
            return
        slots = batch.req_slots[row_idx]
        end = batch.positions[tok_idx] + 1
        self.table[slots, end] = next_ids[tok_idx]
        self.lens[slots] = end + 1
        self._propose_for(slots, max_seq_len + 1)

    def after_decode(self, worker, batch: ForwardBatch, hidden, tokens: torch.Tensor, sb: SamplingBatch | None,
                     draft: bool, fused: bool = False) -> None:
        """After a plain decode step (one token per row, at ``batch.positions``): the new token into the history,
        and the drafts for the next step when ``draft``."""
        slots, end = batch.req_slots, batch.positions + 1
        self.table[slots, end] = tokens
        self.lens[slots] = end + 1
        if draft:
            self._propose_for(slots, batch.max_seq_len + 1)

    def after_verify(self, worker, batch: ForwardBatch, hidden, emitted: torch.Tensor, accepted: torch.Tensor,
                     sb: SamplingBatch) -> None:
        k1 = self.k + 1
        first_new = batch.seq_lens - k1 + 1  # position of emitted[:, 0]
        pos = first_new[:, None] + torch.arange(k1, device=emitted.device)[None, :]
        slots = batch.req_slots
        self.table[slots[:, None].expand_as(pos), pos] = emitted  # entries past the accepted ones are garbage
        self.lens[slots] = first_new + accepted + 1
        self._propose_for(slots, batch.max_seq_len + 1)
