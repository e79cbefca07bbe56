"""The interface every backend implements."""

from __future__ import annotations

import torch

from ..core import ForwardBatch


class Backend:
    """Metadata hooks of a backend. None of them reads a length back from the device (no backend takes host-side
    sequence lengths): that is what lets the overlapped speculative loop launch step N+1 before it knows how many
    drafts step N accepted."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata for an eager forward."""

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Refresh the static metadata before a replay; ``batch.num_padding`` rows at the tail are padding."""


class LinearStateBackend(Backend):
    """A backend of linear-attention layers (GDN, Mamba2): its states live in a ``StatePool``, by state slot."""

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Padded rows get state slot -1: every kernel of these layers skips them (they read zeros and write
        only their own verify rows)."""
        if batch.num_padding:
            batch.state_slots[batch.batch_size - batch.num_padding:] = -1


def slot_states(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The references' read of ``pool[slots]`` in float32, zeros for state slot -1 (a padded row): [B, ...]."""
    valid = (slots >= 0).view(-1, *[1] * (pool.dim() - 1))
    return pool[slots.clamp(min=0)].float() * valid
