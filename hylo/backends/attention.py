"""Full-attention backend over the paged KV pool (torch reference ops; Triton kernels dispatch here on CUDA)."""

from __future__ import annotations

import torch

from ..cache.kv_pool import KVPool
from ..cache.req_slots import ReqSlots
from ..core import ForwardBatch
from ..ops import attention as ops
from .base import Backend


class AttentionBackend(Backend):
    # Grids and gathers are sized from batch.max_seq_len, a host upper bound the scheduler knows.
    needs_cpu_seq_lens = False

    def __init__(self, kv_pool: KVPool, req_slots: ReqSlots):
        self.kv_pool = kv_pool
        self.req_slots = req_slots

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                scaling: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens. ``layer`` indexes the attention layers only."""
        k_cache, v_cache = self.kv_pool.k[layer], self.kv_pool.v[layer]
        ops.store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        if batch.extend_lens_cpu is not None:  # variable-length rows (prefill chunks)
            return ops.extend_attention_ref(q, k_cache, v_cache, self.req_slots.req_to_token, batch.req_slots_cpu,
                                            batch.prefix_lens_cpu, batch.extend_lens_cpu, scaling)
        # fixed shape: tokens_per_row queries per row (decode, verify, draft steps)
        return ops.decode_attention_ref(q, k_cache, v_cache, self.req_slots.req_to_token, batch.req_slots,
                                        batch.seq_lens, batch.max_seq_len, scaling, batch.tokens_per_row)
