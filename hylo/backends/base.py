"""The interface every backend implements."""

from __future__ import annotations

from ..core import ForwardBatch, ForwardMode


class Backend:
    """Metadata hooks of a backend.

    ``needs_cpu_seq_lens`` says whether the backend reads ``batch.seq_lens_cpu``. When no backend in use needs it,
    the batch carries ``None`` there and nothing computes it: that is what lets the overlapped speculative loop
    launch step N+1 before it knows how many drafts step N accepted.
    """

    needs_cpu_seq_lens: bool = False

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata for an eager forward."""

    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:
        """Allocate the static buffers that captured graphs read."""

    def init_forward_metadata_capture(self, bs: int, mode: ForwardMode) -> None:
        """Prepare metadata while capturing a graph of batch size ``bs`` (no padding at capture)."""

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Refresh the static metadata before a replay; ``batch.num_padding`` rows at the tail are padding."""
