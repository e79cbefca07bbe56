"""State pool of the linear-attention (GDN) layers: conv windows and recurrent states, by state slot."""

from __future__ import annotations

import torch


class StatePool:
    """``conv[num_lin_layers, slots + 1, conv_dim, K - 1]`` and ``recurrent[num_lin_layers, slots + 1, Hv, Dk, Dv]``.

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

    def alloc_verify_buffers(self, max_batch: int, steps: int) -> None:
        """Per batch row and verify step, the conv window and recurrent state after that step (speculative decoding).

        ``verify_conv[layer, row, step]``, ``verify_recurrent[layer, row, step]``: indexed by batch row, not slot.
        """
        L, _, C, K1 = self.conv.shape
        _, _, H, Dk, Dv = self.recurrent.shape
        self.verify_conv = torch.zeros(L, max_batch, steps, C, K1, dtype=self.conv.dtype, device=self.conv.device)
        self.verify_recurrent = torch.zeros(L, max_batch, steps, H, Dk, Dv, dtype=self.recurrent.dtype,
                                            device=self.recurrent.device)

    @staticmethod
    def bytes_per_slot(num_layers, conv_dim, conv_kernel, num_v_heads, key_dim, value_dim, conv_dtype,
                       state_dtype) -> int:
        conv = conv_dim * (conv_kernel - 1) * torch.finfo(conv_dtype).bits // 8
        rec = num_v_heads * key_dim * value_dim * torch.finfo(state_dtype).bits // 8
        return num_layers * (conv + rec)

    @property
    def bytes(self) -> int:
        tensors = [self.conv, self.recurrent, self.verify_conv, self.verify_recurrent]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        assert 0 < slot <= self.num_slots and slot not in self._free, f"bad state slot free: {slot}"
        self._free.append(slot)
