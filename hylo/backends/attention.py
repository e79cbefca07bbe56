"""Full-attention backend over the paged KV pool (torch reference ops; Triton kernels dispatch here on CUDA)."""

from __future__ import annotations

import torch

from ..cache.kv_pool import KVPool
from ..cache.req_slots import ReqSlots
from ..core import ForwardBatch, to_device
from ..ops import attention as ops
from ..ops.triton_utils import env_flag, use_triton
from .base import Backend


# HYLO_KV_IN_ROPE=0: the new keys and values stored by their own launch (``ops.store_kv``) instead of by the q/k
# norm-and-rotary kernel that produces the keys (``kv_store``): one launch per attention layer more.
KV_IN_ROPE = env_flag("HYLO_KV_IN_ROPE", True)


class AttentionBackend(Backend):
    # Grids and gathers are sized from batch.max_seq_len, a host upper bound the scheduler knows.

    def __init__(self, kv_pool: KVPool, req_slots: ReqSlots):
        self.kv_pool = kv_pool
        self.req_slots = req_slots
        self.fast = use_triton(kv_pool.k)
        self._plan: tuple | None = None  # (batch, rows for torch's attention, Triton block table) of a prefill

    def _extend_plan(self, batch: ForwardBatch, dim: int) -> tuple[list[int], torch.Tensor | None]:
        """Which rows of a prefill step go to torch's fused attention (long fresh prompts) and the device block
        table of the others for the Triton kernel; built once per forward, shared by its attention layers."""
        from ..ops import attention_extend_triton as ext

        if self._plan is None or self._plan[0] is not batch:
            lens, prefixes = batch.extend_lens_cpu, batch.prefix_lens_cpu
            fused = [i for i, (n, p) in enumerate(zip(lens, prefixes)) if p == 0 and n >= ext.SDPA_MIN_TOKENS]
            skip = set(fused)
            batched = [i for i, n in enumerate(lens) if n and i not in skip]
            blocks = (to_device(ext.query_blocks(batched, lens, ext.block_tokens(dim)), self.kv_pool.k.device)
                      if batched else None)
            self._plan = (batch, fused, blocks)
        return self._plan[1], self._plan[2]

    def _extend_fast(self, q, k_cache, v_cache, batch: ForwardBatch, scaling: float) -> torch.Tensor:
        from ..ops import attention_extend_triton as ext

        fused, blocks = self._extend_plan(batch, q.shape[-1])
        out = torch.empty_like(q)
        if blocks is not None:
            ext.extend_attention_triton(q, k_cache, v_cache, self.req_slots.req_to_token, batch.req_slots,
                                        batch.seq_lens, batch.query_start_loc, blocks, out, scaling)
        if fused:
            ops.extend_attention_sdpa(q, k_cache, v_cache, self.req_slots.req_to_token, batch.req_slots_cpu,
                                      batch.prefix_lens_cpu, batch.extend_lens_cpu, scaling, rows=fused, out=out)
        return out

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Mark the padded tail from ``num_padding`` (host-known): request slot 0 (its req_to_token row is all the
        dummy location 0), a fill length of one row's queries, KV writes to the dummy location."""
        pad = batch.num_padding
        if pad:
            raw = batch.batch_size - pad
            batch.req_slots[raw:] = 0
            batch.seq_lens[raw:] = batch.tokens_per_row
            batch.out_cache_loc[raw * batch.tokens_per_row:] = 0

    def kv_store(self, layer: int, batch: ForwardBatch, dtype: torch.dtype) -> tuple | None:
        """Where a producer of the new tokens' keys and values (of ``dtype``) may write them itself, instead of
        handing them to ``forward``: (key cache, value cache, locations [T]) of the layer, or None where the
        caches' layout or dtype asks for ``ops.store_kv`` (and off the fast path)."""
        k_cache, v_cache = self.kv_pool.k[layer], self.kv_pool.v[layer]
        if not (KV_IN_ROPE and self.fast and k_cache.dtype == dtype and k_cache.is_contiguous()
                and v_cache.is_contiguous() and batch.out_cache_loc.is_contiguous()):
            return None
        return k_cache, v_cache, batch.out_cache_loc

    def store_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
        """The new tokens' keys and values ([T, KVH, D]) into the layer's caches at ``batch.out_cache_loc``, with no
        attention (a pass that only keeps a layer's KV complete)."""
        ops.store_kv(self.kv_pool.k[layer], self.kv_pool.v[layer], batch.out_cache_loc, k, v)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                batch: ForwardBatch, scaling: float, gate: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens, or None when they were written at ``kv_store``'s
        locations already. ``layer`` indexes the attention layers only. With ``gate`` ([T, H * D], rows may be
        strided) the output comes back multiplied by ``sigmoid(gate)``: inside the split attention's merge on the
        decode path, after the attention elsewhere."""
        k_cache, v_cache = self.kv_pool.k[layer], self.kv_pool.v[layer]
        if k is not None:
            ops.store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        r2t = self.req_slots.req_to_token
        if batch.extend_lens_cpu is not None:  # variable-length rows (prefill chunks)
            if self.fast:
                out = self._extend_fast(q, k_cache, v_cache, batch, scaling)
            else:
                out = ops.extend_attention_ref(q, k_cache, v_cache, r2t, batch.req_slots_cpu, batch.prefix_lens_cpu,
                                               batch.extend_lens_cpu, scaling)
            return out if gate is None else ops.output_gate(out, gate)
        # fixed shape: tokens_per_row queries per row (decode, verify, draft steps)
        if self.fast:
            from ..ops.attention_triton import paged_attention

            return paged_attention(q, k_cache, v_cache, r2t, batch.req_slots, batch.seq_lens, scaling,
                                   batch.tokens_per_row, gate=gate)
        out = ops.decode_attention_ref(q, k_cache, v_cache, self.req_slots.req_to_token, batch.req_slots,
                                       batch.seq_lens, batch.max_seq_len, scaling, batch.tokens_per_row)
        return out if gate is None else ops.output_gate(out, gate)
