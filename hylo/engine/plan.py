"""The host-side plan of one step (``ScheduledBatch``): which requests run, how many tokens each feeds, where their
new KV goes, and what else the step carries (prefix-cache copies and snapshots, the speculative step's kind). The
scheduler makes it; the workers turn it into a ForwardBatch; the engine applies its results."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core import ForwardMode, Req


@dataclass
class ScheduledBatch:
    """The host-side plan of one step."""

    reqs: list[Req]
    extend_lens: list[int]  # tokens fed per row
    prefix_lens: list[int]  # tokens already in the cache per row
    sample: list[bool]  # row produces a token in this step (its last known token is fed)
    mode: ForwardMode
    # newly reserved KV positions, one run per entry: req_to_token[slot, first + j] = kv_locs[i][j] for
    # (slot, first) = kv_starts[i] (runs, not per-token lists: an 8192-token chunk's lists cost the host about a
    # millisecond before its first kernel)
    kv_starts: list[tuple[int, int]] = field(default_factory=list)
    kv_locs: list[torch.Tensor] = field(default_factory=list)
    # rows whose inputs (newest token, and for verify rows the position) come from the device tables
    from_device: list[bool] = field(default_factory=list)
    # rows that feed generated tokens (decoding rows, or a resumed request's outputs computed again): the Mamba2
    # families' dt is not clamped for them, as their reference's decode step does not clamp it
    generated: list[bool] = field(default_factory=list)
    admitted: list[Req] = field(default_factory=list)  # requests whose prefill starts in this step
    # prefix caching: state copies (src slot, dst slot) to queue before the forward (a hit's snapshot into the
    # request's slot) and after it (a row's state into a new snapshot); the rows that hit, with the hit length
    copies_before: list[tuple[int, int]] = field(default_factory=list)
    copies_after: list[tuple[int, int]] = field(default_factory=list)
    hits: list[tuple[Req, int]] = field(default_factory=list)
    # snapshots to add to the tree when the row completes: row -> (end position, snapshot slot)
    snapshots: dict[int, tuple[int, int]] = field(default_factory=dict)
    # speculative decoding: a DECODE step ends by drafting for the next step (which is to verify); see spec_policy
    draft_after: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def kv_triples(self) -> torch.Tensor | None:
        """The new KV positions as one host int64 tensor [3, W] of (request slot, position, location), or None."""
        if not self.kv_locs:
            return None
        locs = torch.cat(self.kv_locs).to(torch.int64)
        counts = torch.tensor([t.numel() for t in self.kv_locs], dtype=torch.int64)
        slots, firsts = torch.tensor(self.kv_starts, dtype=torch.int64).T
        run, cols = expand_runs(torch.cat([counts.new_zeros(1), counts.cumsum(0)]), firsts, locs.numel())
        return torch.stack([slots[run], cols, locs])

    def prompt_logprob_spans(self) -> list[tuple[int, int, int]]:
        """(row, first position, positions) of the fed prompt positions whose next token is a prompt token, for the
        prefill rows of requests that asked for prompt log probabilities."""
        out = []
        for i, (req, n, p, dev) in enumerate(zip(self.reqs, self.extend_lens, self.prefix_lens, self.from_device)):
            if dev or req.params.prompt_logprobs is None:
                continue
            count = min(p + n, len(req.prompt_ids) - 1) - p
            if count > 0:
                out.append((i, p, count))
        return out


def expand_runs(offsets: torch.Tensor, firsts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs laid end to end: run r covers the entries [offsets[r], offsets[r + 1]) and counts up from firsts[r].
    Returns each of the ``total`` entries' run and value (the KV runs' positions; the rows' token positions)."""
    run = torch.repeat_interleave(torch.arange(firsts.numel(), device=firsts.device), offsets.diff(),
                                  output_size=total)
    return run, torch.arange(total, device=firsts.device) - offsets[run] + firsts[run]
