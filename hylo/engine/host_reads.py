"""The one gate for device-to-host reads in the engine loop (DESIGN section 7).

Every read of a step's results goes through ``HostReads.read``, so the number of blocking reads per step is a
counted fact, not a hope. The plain loop makes exactly one per step (the new tokens, with the accepted counts packed
into the same tensor); the overlapped loop will replace it with a non-blocking copy into pinned memory plus an
event.
"""

from __future__ import annotations

import torch


class HostReads:
    def __init__(self):
        self.blocking = 0  # reads that waited for the device (every read of a device tensor in the plain loop)

    def read(self, t: torch.Tensor) -> list:
        self.blocking += 1
        return t.tolist()
