"""State pool of the linear-attention layers (Gated DeltaNet or Mamba2): conv windows and recurrent states, by state
slot."""

from __future__ import annotations

import torch

from ..core import to_device


class StatePool:
    """``conv[num_lin_layers, slots + 1, conv_dim, K - 1]`` and ``recurrent[num_lin_layers, slots + 1, H, A, B]``:
    a GDN layer's ``[Hv, Dk, Dv]`` state per value head, a Mamba2 layer's ``[H, P, N]`` (``ModelConfig.state_dims``).

    NOTE: slot 0 is reserved (never handed out): kernels redirect rows whose state slot is -1 to it and write back
    its own contents, so a skipped row changes nothing. A slot is zeroed when it is handed out, so a new request
    starts from the zero state without any kernel having to know it is new.
    """

    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                 key_dim: int, value_dim: int, conv_dtype: torch.dtype, state_dtype: torch.dtype,
                 device: torch.device):
        self.num_slots = num_slots
        layers = max(num_layers, 1)
        self.conv = torch.zeros(layers, num_slots + 1, conv_dim, conv_kernel - 1, dtype=conv_dtype, device=device)
        self.recurrent = torch.zeros(layers, num_slots + 1, num_v_heads, key_dim, value_dim, dtype=state_dtype,
                                     device=device)
        self._free = list(range(num_slots, 0, -1))
        self.verify_conv: torch.Tensor | None = None
        self.verify_recurrent: torch.Tensor | None = None
        self.verify_x: torch.Tensor | None = None
        self.verify_ab: torch.Tensor | None = None

    def alloc_verify_buffers(self, max_batch: int, steps: int, keep_inputs: bool = False,
                             act_dtype: torch.dtype | None = None) -> None:
        """What a verify keeps per batch row and step (speculative decoding), indexed by batch row, not slot:
        ``verify_conv[layer, row, step]``, the conv window after the step, and either the recurrent state after the
        step, ``verify_recurrent[layer, row, step]`` (the commit copies the accepted one), or with ``keep_inputs``
        the step's inputs, ``verify_x[layer, row * steps + step]`` (the conv output, q | k | v) and
        ``verify_ab[layer, row * steps + step]`` (the raw gate inputs a and b), from which the commit replays the
        accepted steps (a fraction of the state traffic and memory: see ``ops/gdn_triton``)."""
        L, _, C, K1 = self.conv.shape
        _, _, H, Dk, Dv = self.recurrent.shape
        dev = self.conv.device
        self.verify_conv = torch.zeros(L, max_batch, steps, C, K1, dtype=self.conv.dtype, device=dev)
        if keep_inputs:
            dtype = act_dtype or self.conv.dtype
            self.verify_x = torch.zeros(L, max_batch * steps, C, dtype=dtype, device=dev)
            self.verify_ab = torch.zeros(L, max_batch * steps, 2, H, dtype=dtype, device=dev)
        else:
            self.verify_recurrent = torch.zeros(L, max_batch, steps, H, Dk, Dv, dtype=self.recurrent.dtype,
                                                device=dev)

    @staticmethod
    def verify_bytes_per_row(num_layers, conv_dim, conv_kernel, num_v_heads, key_dim, value_dim, conv_dtype,
                             state_dtype, steps: int, keep_inputs: bool) -> int:
        """The verify buffers' bytes per batch row (``alloc_verify_buffers``)."""
        size = lambda dtype: torch.finfo(dtype).bits // 8  # noqa: E731
        conv = conv_dim * (conv_kernel - 1) * size(conv_dtype)
        kept = ((conv_dim + 2 * num_v_heads) * size(conv_dtype) if keep_inputs
                else num_v_heads * key_dim * value_dim * size(state_dtype))
        return num_layers * steps * (conv + kept)

    @staticmethod
    def bytes_per_slot(num_layers, conv_dim, conv_kernel, num_v_heads, key_dim, value_dim, conv_dtype,
                       state_dtype) -> int:
        conv = conv_dim * (conv_kernel - 1) * torch.finfo(conv_dtype).bits // 8
        rec = num_v_heads * key_dim * value_dim * torch.finfo(state_dtype).bits // 8
        return num_layers * (conv + rec)

    @property
    def bytes(self) -> int:
        tensors = [self.conv, self.recurrent, self.verify_conv, self.verify_recurrent, self.verify_x, self.verify_ab]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, zero: bool = True) -> int | None:
        """A free slot, zeroed (a new request's start) unless ``zero`` is False (a copy will fill it)."""
        if not self._free:
            return None
        slot = self._free.pop()
        if zero:
            self.conv[:, slot].zero_()
            self.recurrent[:, slot].zero_()
        return slot

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """``slot[dst] = slot[src]`` (conv windows and recurrent states of every layer) for each (src, dst), queued on
        the device in two launches: a prefix-cache hit's snapshot into the request's slot, or a running request's
        state into a new snapshot."""
        if not pairs:
            return
        idx = to_device(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), self.conv.device)
        src, dst = idx[0], idx[1]
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    def poison(self, slot: int) -> None:
        """Fill a freed slot with NaN (tests: whatever still read it would show)."""
        self.conv[:, slot].fill_(float("nan"))
        self.recurrent[:, slot].fill_(float("nan"))

    def free(self, slot: int) -> None:
        assert 0 < slot <= self.num_slots and slot not in self._free, f"bad state slot free: {slot}"
        self._free.append(slot)
