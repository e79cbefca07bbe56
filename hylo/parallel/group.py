"""The tensor-parallel group a model runs in: rank, size and the two collectives the model needs (torch.distributed:
gloo on CPU, NCCL on CUDA). A size-1 group does nothing, so the single-GPU path pays nothing for it."""

from __future__ import annotations

import torch


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1, group=None):
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results of a row-parallel projection (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' slices along the last dimension (vocab-parallel logits)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
