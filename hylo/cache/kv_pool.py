"""KV pool of the full-attention layers, page size 1 (one location per token)."""

from __future__ import annotations

import torch


class KVPool:
    """Keys and values ``[num_attn_layers, num_tokens + 1, kv_heads, head_dim]``.

    NOTE: location 0 is a dummy that padded rows write to; real tokens live at 1..num_tokens. The free list is a
    host-side stack: allocation and freeing never touch the device.
    """

    def __init__(self, num_layers: int, num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_tokens = num_tokens
        shape = (max(num_layers, 1), num_tokens + 1, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._stack = torch.arange(num_tokens, 0, -1, dtype=torch.int64)  # host stack; top is the end
        self._top = num_tokens

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free locations (host int64 tensor), or None if there are not enough."""
        if n > self._top:
            return None
        self._top -= n
        return self._stack[self._top:self._top + n].clone()

    def free(self, locs: torch.Tensor) -> None:
        n = locs.numel()
        assert self._top + n <= self.num_tokens, "KV pool: more locations freed than allocated"
        self._stack[self._top:self._top + n] = locs.cpu()
        self._top += n

    def poison(self, locs: torch.Tensor) -> None:
        """Fill freed locations with NaN (tests: whatever still read them would show)."""
        idx = locs.to(self.k.device)
        self.k[:, idx] = float("nan")
        self.v[:, idx] = float("nan")
