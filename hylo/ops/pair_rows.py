"""A MoE's output one step before its per-token sums, the noun the MoE kernels and the residual add share: the MoE
of a large prefill chunk hands its rows in expert order to ``ops.norm.add_rms_norm``, which sums them as it reads
the residual. Its own module, so that the MoE and norm kernels import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_utils import use_triton


@dataclass(frozen=True)
class SortedPairRows:
    """A MoE's output one step before its per-token sums (the grouped-GEMM path of large prefill chunks): ``ys``
    [P, H] the pairs' down-projected rows in expert order, unweighted; ``pos`` [T * k] each pair's row in ``ys``;
    ``weights`` [T * k] the routing weights. Token t's output is the sum over j of weights[t * k + j] *
    ys[pos[t * k + j]], in float32. The residual add that follows (``ops.norm.add_rms_norm``) forms those sums
    as it reads the residual, so the [T, H] float32 sums never go through memory."""

    ys: torch.Tensor
    pos: torch.Tensor
    weights: torch.Tensor
    top_k: int

    @property
    def num_tokens(self) -> int:
        return self.pos.numel() // self.top_k

    def reduce(self) -> torch.Tensor:
        """The per-token sums, [T, 1, H] float32."""
        if use_triton(self.ys):
            from .pair_rows_triton import gather_sum

            return gather_sum(self.ys, self.pos, self.weights, self.top_k)
        rows = self.ys.index_select(0, self.pos).float() * self.weights.float()[:, None]
        return rows.view(self.num_tokens, self.top_k, -1).sum(1, keepdim=True)
