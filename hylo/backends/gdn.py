"""Gated DeltaNet backend: causal conv and the gated delta rule over the state pool, per forward mode.

- EXTEND: conv over the new tokens from the slot's conv window, chunked delta rule from the slot's recurrent state,
  both final states written back to the slot (a chunk continues exactly where the previous one stopped).
- DECODE: one conv update and one recurrent step, reading and writing the slot in place.
- TARGET_VERIFY: k + 1 steps from the slot, and what the commit needs kept in the verify buffers at ``[row, step]``:
  the step's inputs (``spec_commit="replay"``, the default) or the state after the step ("checkpoints"). The slot
  itself is never written by a verify (a rejected draft needs no rollback); ``commit_verified`` then brings each
  row's state to its last accepted step, replaying the kept inputs from the slot or copying the checkpoint.
State slot -1 marks a padded row everywhere: it reads zeros and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.state_pool import StatePool
from ..core import ForwardBatch, ForwardMode, to_device
from ..ops import conv1d as conv_ops
from ..ops import gdn as gdn_ops
from ..ops.triton_utils import INTERPRET, use_triton
from .base import LinearStateBackend, slot_states


FLA_CHUNK = 64  # the chunk length of fla's chunked gated delta rule (its default), for the chunk index we build


def _load_fla_chunk():
    """flash-linear-attention's chunked gated delta rule (the ``fla-core`` package), if installed and on a GPU."""
    if INTERPRET:  # fla's kernels need a real device
        return None
    from ..ops import gdn_fla

    return gdn_fla.load()


@dataclass(frozen=True)
class GDNShape:
    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    def split(self, mixed: torch.Tensor):
        """[..., conv_dim] -> q, k [..., Hk, Dk] and v [..., Hv, Dv]."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        lead = mixed.shape[:-1]
        return (q.reshape(*lead, self.num_k_heads, self.head_k_dim),
                k.reshape(*lead, self.num_k_heads, self.head_k_dim),
                v.reshape(*lead, self.num_v_heads, self.head_v_dim))


@dataclass
class GDNParams:
    """One GDN layer's parameters that the backend needs (views of the layer's own tensors)."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]


@dataclass
class PrefillIndex:
    """The index tensors of one prefill forward on the fast path, built once from the host-side lists and shared by
    every GDN layer. Built per layer they cost eight host-device synchronisations per layer (blocking copies of
    Python lists, list-indexed writes, fla reading its sequence offsets back): an 8192-token prefill of bench-6b
    spent 147 ms on the wall for 90 ms of GPU time."""

    token_row: torch.Tensor  # [T] row of every token (the conv kernel's)
    slot_or_zero: torch.Tensor  # [B] state slot, -1 replaced by 0 (a valid address to gather from)
    has_slot: torch.Tensor  # [B] 1 where slot >= 0, else 0 (int64)
    kept_rows: torch.Tensor  # [R] rows with a slot, and
    kept_slots: torch.Tensor  # [R] their slots: where the final states go
    cu_seqlens: torch.Tensor  # [B + 1] token offsets, on the device, and
    cu_seqlens_cpu: torch.Tensor  # the same on the host, which spares fla its read-back
    chunk_indices: torch.Tensor  # [chunks, 2] (row, chunk within the row) of fla's chunks: fla would build it
    # on the host and copy it with a blocking copy (the one synchronisation left in an 8192-token prefill)
    all_slots: bool = True  # every row has a state slot (kept_rows is then every row, in order)

    @classmethod
    def build(cls, slots: list[int], lens: list[int], device,
              token_row: torch.Tensor | None = None) -> "PrefillIndex":
        """``token_row``: the tokens' rows when the batch has them on the device already (else built here)."""
        kept = [i for i, s in enumerate(slots) if s >= 0]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        chunk_rows, chunk_pos = [], []
        for row, n in enumerate(lens):
            c = (n + FLA_CHUNK - 1) // FLA_CHUNK
            chunk_rows += [row] * c
            chunk_pos += range(c)
        # Python lists, then one tensor and one copy for all of them (built as seven host tensors they cost about
        # 0.4 ms before the first layer of an 8192-token prefill on the H200's host), then views
        parts = dict(slot_or_zero=[max(s, 0) for s in slots], has_slot=[int(s >= 0) for s in slots],
                     kept_rows=kept, kept_slots=[slots[i] for i in kept], cu_seqlens=cu,
                     chunk_indices=[v for pair in zip(chunk_rows, chunk_pos) for v in pair])
        flat = torch.tensor([v for values in parts.values() for v in values], dtype=torch.long)
        flat_dev = to_device(flat, device)
        views, at = {}, 0
        for name, values in parts.items():
            views[name] = flat_dev[at:at + len(values)]
            if name == "cu_seqlens":
                cu_cpu = flat[at:at + len(values)]
            at += len(values)
        views["chunk_indices"] = views["chunk_indices"].view(-1, 2)
        if token_row is None:
            token_row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))
            token_row = to_device(token_row, device)
        return cls(cu_seqlens_cpu=cu_cpu, all_slots=len(kept) == len(slots), token_row=token_row, **views)


class GDNBackend(LinearStateBackend):

    def __init__(self, state_pool: StatePool):
        self.state_pool = state_pool
        self.fast = use_triton(state_pool.recurrent)
        self.fla_chunk = _load_fla_chunk() if self.fast else None
        self._prefill: tuple[ForwardBatch, PrefillIndex] | None = None  # the batch it was built for, and it
        # for the replay commit: each layer's gate parameters (seen by its verify), stacked once, and the shape
        self._layer_params: dict[int, GDNParams] = {}
        self._gates: tuple[torch.Tensor, torch.Tensor] | None = None
        self._shape: GDNShape | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """An eager forward: a prefill on the fast path gets its index tensors once, for every layer."""
        self._prefill = None
        if self.fast and batch.mode.is_extend:
            self._prefill_index(batch)

    def forward(self, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params: GDNParams,
                shape: GDNShape, batch: ForwardBatch) -> torch.Tensor:
        """mixed_qkv: [T, conv_dim]; a, b: [T, Hv]. ``layer`` indexes the linear layers only.
        Returns the core output [T, Hv, Dv] in float32 (from fla's prefill kernel: in the activations' dtype)."""
        conv_pool = self.state_pool.conv[layer]
        rec_pool = self.state_pool.recurrent[layer]
        if self.fast and not batch.mode.is_extend:
            return self._steps_triton(layer, conv_pool, rec_pool, mixed_qkv, a, b, params, shape, batch)
        if batch.mode.is_extend:
            return self._extend(conv_pool, rec_pool, mixed_qkv, a, b, params, shape, batch)
        g, beta = gdn_ops.gdn_gating(params.A_log, a, params.dt_bias, b)
        if batch.mode.is_decode:
            x = conv_ops.causal_conv1d_update_ref(mixed_qkv, conv_pool, params.conv_weight, batch.state_slots)
            q, k, v = shape.split(x)
            return gdn_ops.gdn_decode_ref(q, k, v, g, beta, rec_pool, batch.state_slots)
        assert batch.mode is ForwardMode.TARGET_VERIFY
        return self._verify(layer, conv_pool, rec_pool, mixed_qkv, a, b, g, beta, params, shape, batch)

    def _extend(self, conv_pool, rec_pool, mixed_qkv, a, b, params, shape, batch):
        """Prefill: the causal conv from each row's conv state (one varlen Triton launch on CUDA, per row otherwise),
        then the chunked delta rule from each row's recurrent state (fla's varlen kernel when installed)."""
        if self.fast:
            from ..ops.conv1d_triton import conv_prefill

            # for fla: q, k and v as three contiguous planes, so that its kernels need no copies of them, q and k
            # L2-normalised on the way where the conv kernel can (fla would otherwise do it in two more passes)
            fla = self.fla_chunk is not None
            x = conv_prefill(mixed_qkv, params.conv_weight, conv_pool, batch.state_slots, batch.query_start_loc,
                             batch.extend_lens_cpu, self._prefill_index(batch).token_row,
                             (shape.key_dim, shape.key_dim) if fla else None,
                             l2norm_head=shape.head_k_dim if fla else 0)
        else:
            xs, start = [], 0
            for slot, length in zip(batch.state_slots_cpu, batch.extend_lens_cpu):
                x, new_conv = conv_ops.causal_conv1d_ref(mixed_qkv[start:start + length],
                                                         conv_pool[slot] if slot >= 0 else None, params.conv_weight)
                if slot >= 0:
                    conv_pool[slot] = new_conv.to(conv_pool.dtype)
                xs.append(x)
                start += length
            x = torch.cat(xs)
        if self.fla_chunk is not None:
            return self._chunk_fla(rec_pool, x[:3], a, b, params, shape, batch, qk_normed=x[3])
        g, beta = gdn_ops.gdn_gating(params.A_log, a, params.dt_bias, b)
        out = torch.empty(x.shape[0], shape.num_v_heads, shape.head_v_dim, dtype=torch.float32, device=x.device)
        start = 0
        for slot, length in zip(batch.state_slots_cpu, batch.extend_lens_cpu):
            end = start + length
            q, k, v = shape.split(x[start:end])
            o, new_rec = gdn_ops.chunk_gated_delta_rule_ref(q, k, v, g[start:end], beta[start:end],
                                                            rec_pool[slot] if slot >= 0 else None)
            out[start:end] = o
            if slot >= 0:
                rec_pool[slot] = new_rec.to(rec_pool.dtype)
            start = end
        return out

    def _steps_triton(self, layer, conv_pool, rec_pool, mixed_qkv, a, b, params, shape, batch):
        """Decode (S = 1, slot in place) or verify (S = k + 1, every step to the verify buffers), fused kernels."""
        from ..ops.conv1d_triton import conv_steps
        from ..ops.gdn_triton import gdn_steps

        pool = self.state_pool
        verify = batch.mode is ForwardMode.TARGET_VERIFY
        keep = verify and self._note_verify_layer(layer, params, shape)
        steps, n = batch.tokens_per_row, mixed_qkv.shape[0]
        # keeping inputs, the conv writes its output straight into the verify buffer the replay reads
        x = conv_steps(mixed_qkv, params.conv_weight, conv_pool, batch.state_slots, steps,
                       pool.verify_conv[layer] if verify else None, out=pool.verify_x[layer, :n] if keep else None)
        return gdn_steps(x, a, b, params.A_log, params.dt_bias, rec_pool, batch.state_slots, shape.num_k_heads,
                         shape.head_k_dim, shape.head_v_dim, steps,
                         pool.verify_recurrent[layer] if verify and not keep else None,
                         keep_ab=pool.verify_ab[layer] if keep else None)

    def _note_verify_layer(self, layer: int, params: GDNParams, shape: GDNShape) -> bool:
        """Note what the replay commit needs of this verifying layer (its gate parameters, the shape) and say
        whether verifies keep inputs for that commit at all (False: the state checkpoints are kept instead)."""
        if self.state_pool.verify_x is None:
            return False
        old = self._layer_params.get(layer)
        if old is None or old.A_log is not params.A_log or old.dt_bias is not params.dt_bias:
            self._gates = None  # restacked by the next commit
        self._layer_params[layer] = params
        self._shape = shape
        return True

    def commit_verified(self, state_slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a verify: each row's conv window and recurrent state at its last accepted step (``accepted[row]``,
        0 = the fed token alone) into its slot. Rows with state slot -1 write nothing."""
        pool = self.state_pool
        if pool.verify_x is None:
            commit_checkpoints(pool, state_slots, accepted)
            return
        commit_checkpoints(pool, state_slots, accepted, recurrent=False)  # the conv windows are small: copied
        shape, steps = self._shape, pool.verify_conv.shape[2]
        if self.fast:
            from ..ops.gdn_triton import replay_commit

            if self._gates is None:  # built by the first (eager) commit, before any graph capture
                layers = [self._layer_params[i] for i in range(len(self._layer_params))]
                self._gates = (torch.stack([p.A_log for p in layers]), torch.stack([p.dt_bias for p in layers]))
            replay_commit(pool.verify_x, pool.verify_ab, *self._gates, pool.recurrent, state_slots, accepted,
                          shape.num_k_heads, shape.head_k_dim, shape.head_v_dim, steps)
            return
        bs = state_slots.shape[0]
        n = bs * steps
        rows = torch.arange(bs, device=state_slots.device)
        valid = state_slots >= 0
        idx = state_slots.clamp(min=0)
        for layer, params in sorted(self._layer_params.items()):
            g, beta = gdn_ops.gdn_gating(params.A_log, pool.verify_ab[layer, :n, 0], params.dt_bias,
                                         pool.verify_ab[layer, :n, 1])
            q, k, v = shape.split(pool.verify_x[layer, :n].view(bs, steps, -1))
            rec = pool.recurrent[layer]
            rec0 = slot_states(rec, state_slots)
            _, states = gdn_ops.gdn_verify_ref(q, k, v, g.view(bs, steps, -1), beta.view(bs, steps, -1), rec0)
            final = states[rows, accepted].to(rec.dtype)
            rec[idx] = torch.where(valid[:, None, None, None], final, rec[idx])

    def _prefill_index(self, batch: ForwardBatch) -> PrefillIndex:
        """This batch's index tensors, built on first use (by ``init_forward_metadata``, or by the first layer of
        a forward that was called directly)."""
        if self._prefill is None or self._prefill[0] is not batch:
            self._prefill = (batch, PrefillIndex.build(batch.state_slots_cpu, batch.extend_lens_cpu,
                                                       self.state_pool.recurrent.device, batch.token_rows))
        return self._prefill[1]

    def _chunk_fla(self, rec_pool, planes, a, b, params, shape, batch, qk_normed=False):
        """One varlen chunked delta rule (fla) for all rows, starting from and ending in their slots. ``planes``:
        the conv output's q, k, v, each contiguous (q and k L2-normalised already if ``qk_normed``); a, b: the raw
        gate inputs (the gate is computed inside)."""
        ix = self._prefill_index(batch)
        # more value than key heads go in as they are: fla maps value head h to key head h // (Hv / Hk) itself
        tokens = planes[0].shape[0]
        q = planes[0].view(tokens, shape.num_k_heads, shape.head_k_dim)
        k = planes[1].view(tokens, shape.num_k_heads, shape.head_k_dim)
        v = planes[2].view(tokens, shape.num_v_heads, shape.head_v_dim)
        init = rec_pool.index_select(0, ix.slot_or_zero).float()
        if not ix.all_slots:  # rows without a state slot start from zeros
            init.mul_(ix.has_slot[:, None, None, None])
        o, final = self.fla_chunk(q, k, v, a, b, params.A_log, params.dt_bias, init, ix.cu_seqlens,
                                  ix.cu_seqlens_cpu, ix.chunk_indices, FLA_CHUNK, qk_normed)
        if ix.all_slots:  # the common case in one launch (an 8192-token prefill launches about 800 kernels)
            rec_pool.index_copy_(0, ix.kept_slots, final.to(rec_pool.dtype))
        else:
            rec_pool[ix.kept_slots] = final[ix.kept_rows].to(rec_pool.dtype)
        return o  # in the inputs' dtype: the layer casts the core output to it anyway (no float32 round trip)

    def _verify(self, layer, conv_pool, rec_pool, mixed_qkv, a, b, g, beta, params, shape, batch):
        """k + 1 steps per row from the slot's state; the conv windows and either the step inputs or the states after
        every step go to the verify buffers."""
        pool = self.state_pool
        bs, steps = batch.batch_size, batch.tokens_per_row
        conv0 = slot_states(conv_pool, batch.state_slots).to(conv_pool.dtype)
        rec0 = slot_states(rec_pool, batch.state_slots)
        x, conv_states = conv_ops.causal_conv1d_windows_ref(
            mixed_qkv.view(bs, steps, -1), conv0, params.conv_weight)
        q, k, v = shape.split(x)
        o, rec_states = gdn_ops.gdn_verify_ref(q, k, v, g.view(bs, steps, -1), beta.view(bs, steps, -1), rec0)
        pool.verify_conv[layer, :bs] = conv_states.to(pool.verify_conv.dtype)
        if self._note_verify_layer(layer, params, shape):
            n = bs * steps
            pool.verify_x[layer, :n] = x.reshape(n, -1).to(pool.verify_x.dtype)
            pool.verify_ab[layer, :n, 0] = a
            pool.verify_ab[layer, :n, 1] = b
        else:
            pool.verify_recurrent[layer, :bs] = rec_states.to(pool.verify_recurrent.dtype)
        return o.reshape(bs * steps, shape.num_v_heads, shape.head_v_dim)


def commit_checkpoints(pool: StatePool, state_slots: torch.Tensor, accepted: torch.Tensor,
                       recurrent: bool = True) -> None:
    """Copy each row's verify checkpoint after its last accepted token (``verify[row, a]``) into its state slot:
    the conv window, and the recurrent state unless ``recurrent`` is False. Rows with state slot -1 write nothing."""
    if use_triton(state_slots):
        from ..ops.gdn_triton import commit_checkpoints as commit

        commit(pool.verify_conv, pool.conv, state_slots, accepted)
        if recurrent:
            commit(pool.verify_recurrent, pool.recurrent, state_slots, accepted)
        return
    rows = torch.arange(state_slots.shape[0], device=state_slots.device)
    valid = state_slots >= 0
    idx = state_slots.clamp(min=0)
    conv = pool.verify_conv[:, rows, accepted].to(pool.conv.dtype)  # [L, B, C, K-1]
    pool.conv[:, idx] = torch.where(valid[None, :, None, None], conv, pool.conv[:, idx])
    if recurrent:
        rec = pool.verify_recurrent[:, rows, accepted].to(pool.recurrent.dtype)  # [L, B, Hv, Dk, Dv]
        pool.recurrent[:, idx] = torch.where(valid[None, :, None, None, None], rec, pool.recurrent[:, idx])
