"""Mamba2 backend: the causal conv (with bias) and the SSD recurrence over the state pool, per forward mode, under
the contract the GDN backend keeps (DESIGN.md sections 4 and 10).

- EXTEND: the conv over the new tokens from the slot's conv window, the chunked scan from the slot's state, both
  final states written back (a chunk continues exactly where the previous one stopped).
- DECODE: one conv update and one recurrence step, reading and writing the slot in place.
- TARGET_VERIFY: k + 1 steps from the slot, keeping the conv window and the state after every step in the verify
  buffers at ``[row, step]`` (the "checkpoints" commit); the slot itself is never written, and
  ``commit_verified`` copies each row's last accepted checkpoint into it.
State slot -1 marks a padded row: it reads zeros and writes nothing. The pool's recurrent state of a Mamba2 layer
is ``[H, P, N]`` (heads, head channels, state size) where a GDN layer's is ``[Hv, Dk, Dv]``.

On CUDA a step is two Triton launches per layer: the conv with its bias (``ops.conv1d_triton``'s ``conv_steps``,
or ``conv_prefill`` for a prefill's rows) and the recurrence (``ops/mamba2_triton.py``'s ``mamba2_steps`` for decode
and verify); a prefill's rows go through ``ops/mamba2_scan_triton.py``'s ``mamba2_scan`` (long rows cut into
segments that scan side by side: one launch more).
As in transformers and the released kernels, prefill clamps dt to the config's limit and a decode step does not:
here a prompt's tokens are clamped whatever step computes them (a one-token chunk runs as EXTEND, never DECODE) and
a generated token never is (a decoding row riding along in a prefill step included), so that a request's output
does not depend on its chunking or on what shared its steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.state_pool import StatePool
from ..config import Mamba2Spec
from ..core import ForwardBatch, ForwardMode
from ..ops import conv1d as conv_ops
from ..ops import mamba2 as ops
from ..ops.triton_utils import use_triton
from .base import LinearStateBackend, slot_states
from .gdn import commit_checkpoints


def split_xbc(shape: Mamba2Spec, xbc: torch.Tensor):
    """[..., conv_dim] -> x [..., H, P], B and C [..., G, N]."""
    gn = shape.n_groups * shape.state_size
    x, B, C = xbc.split([shape.inner, gn, gn], dim=-1)
    lead = xbc.shape[:-1]
    return (x.reshape(*lead, shape.num_heads, shape.head_dim), B.reshape(*lead, shape.n_groups, shape.state_size),
            C.reshape(*lead, shape.n_groups, shape.state_size))


@dataclass
class Mamba2Params:
    """One Mamba2 layer's parameters that the backend needs (views of the layer's own tensors)."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A_log: torch.Tensor  # [H]
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    dt_limit: tuple[float, float]  # prefill's clamp of softplus(dt + dt_bias)
    chunk_size: int = 128  # the prefill scan's chunk (the result does not depend on it)


class Mamba2Backend(LinearStateBackend):

    def __init__(self, state_pool: StatePool):
        self.state_pool = state_pool
        self.fast = use_triton(state_pool.recurrent)  # every mode's conv and recurrence in Triton (module docstring)
        self._plan = None  # (batch, its prefill scan's segments): built by the first Mamba2 layer of a prefill

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._plan = None

    def _scan_plan(self, batch: ForwardBatch, shape: Mamba2Spec):
        """The prefill's rows cut into scan segments, once per batch (every Mamba2 layer of a model has one
        shape)."""
        if self._plan is None or self._plan[0] is not batch:
            from ..ops.mamba2_scan_triton import SCAN_CHUNK, ScanPlan, channel_block

            per_segment = shape.num_heads * -(-shape.head_dim // channel_block(shape.head_dim))
            self._plan = (batch, ScanPlan.build(batch.extend_lens_cpu, self.state_pool.recurrent.device, per_segment,
                                                SCAN_CHUNK, unclamped=batch.generated_rows_cpu))
        return self._plan[1]

    def forward(self, layer: int, xbc: torch.Tensor, dt: torch.Tensor, params: Mamba2Params, shape: Mamba2Spec,
                batch: ForwardBatch) -> torch.Tensor:
        """xbc: [T, conv_dim] (before the conv); dt: [T, H] raw. ``layer`` indexes the linear layers only.
        Returns y [T, H, P] (the D skip included, before the gated norm): in float32 for a prefill; a decode or
        verify step's in float32 from the references, in xbc's dtype from the Triton kernel (rounded at its store,
        as the mixer rounds the references' output)."""
        conv_pool = self.state_pool.conv[layer]
        rec_pool = self.state_pool.recurrent[layer]
        if batch.mode.is_extend:
            return self._extend(conv_pool, rec_pool, xbc, dt, params, shape, batch)
        if self.fast:  # conv and recurrence steps: one Triton launch each (the kernels compute A themselves)
            from ..ops.conv1d_triton import conv_steps

            pool, verify = self.state_pool, batch.mode is ForwardMode.TARGET_VERIFY
            x = conv_steps(xbc, params.conv_weight, conv_pool, batch.state_slots, batch.tokens_per_row,
                           pool.verify_conv[layer] if verify else None, bias=params.conv_bias)
            return self._steps_triton(x, dt, rec_pool, params, shape, batch,
                                      pool.verify_recurrent[layer] if verify else None)
        A = -torch.exp(params.A_log.float())
        if batch.mode.is_decode:
            x = conv_ops.causal_conv1d_update_ref(xbc, conv_pool, params.conv_weight, batch.state_slots,
                                                  params.conv_bias)
            xs, B, C = split_xbc(shape, x)
            return ops.ssd_decode_ref(xs, ops.discretize(dt, params.dt_bias), A, B, C, params.D, rec_pool,
                                      batch.state_slots)
        assert batch.mode is ForwardMode.TARGET_VERIFY
        return self._verify(layer, conv_pool, rec_pool, xbc, dt, A, params, shape, batch)

    def _extend(self, conv_pool, rec_pool, xbc, dt, params, shape, batch):
        """Prefill: the conv from each row's conv window, then the scan from each row's state: on CUDA one Triton
        launch each for all rows, elsewhere the references row by row."""
        if self.fast:
            from ..ops.conv1d_triton import conv_prefill
            from ..ops.mamba2_scan_triton import mamba2_scan

            x = conv_prefill(xbc, params.conv_weight, conv_pool, batch.state_slots, batch.query_start_loc,
                             batch.extend_lens_cpu, batch.token_rows, bias=params.conv_bias)
            return mamba2_scan(x, dt, params.A_log, params.D, params.dt_bias, rec_pool, batch.state_slots,
                               self._scan_plan(batch, shape), shape.num_heads, shape.head_dim, shape.n_groups,
                               shape.state_size, params.dt_limit)
        A = -torch.exp(params.A_log.float())
        out = torch.empty(xbc.shape[0], shape.num_heads, shape.head_dim, dtype=torch.float32, device=xbc.device)
        start = 0
        generated = batch.generated_rows_cpu or [False] * len(batch.extend_lens_cpu)
        for slot, length, gen in zip(batch.state_slots_cpu, batch.extend_lens_cpu, generated):
            end = start + length
            limit = None if gen else params.dt_limit  # generated tokens: the decode step's unclamped dt
            x, new_conv = conv_ops.causal_conv1d_ref(xbc[start:end], conv_pool[slot] if slot >= 0 else None,
                                                     params.conv_weight, params.conv_bias)
            xs, B, C = split_xbc(shape, x)
            y, state = ops.ssd_chunk_scan_ref(xs, ops.discretize(dt[start:end], params.dt_bias, limit), A,
                                              B, C, params.D, rec_pool[slot] if slot >= 0 else None,
                                              chunk_size=params.chunk_size)
            out[start:end] = y
            if slot >= 0:
                conv_pool[slot] = new_conv.to(conv_pool.dtype)
                rec_pool[slot] = state.to(rec_pool.dtype)
            start = end
        return out

    def _verify(self, layer, conv_pool, rec_pool, xbc, dt, A, params, shape, batch):
        pool = self.state_pool
        steps = batch.tokens_per_row
        bs = xbc.shape[0] // steps
        conv0 = slot_states(conv_pool, batch.state_slots)
        x, conv_states = conv_ops.causal_conv1d_windows_ref(xbc.view(bs, steps, -1), conv0, params.conv_weight,
                                                            params.conv_bias)
        pool.verify_conv[layer, :bs] = conv_states.to(pool.verify_conv.dtype)
        xs, B, C = split_xbc(shape, x)
        rec0 = slot_states(rec_pool, batch.state_slots)
        y, states = ops.ssd_verify_ref(xs, ops.discretize(dt.view(bs, steps, -1), params.dt_bias), A, B, C,
                                       params.D, rec0)
        pool.verify_recurrent[layer, :bs] = states.to(pool.verify_recurrent.dtype)
        return y.reshape(bs * steps, shape.num_heads, shape.head_dim)

    @staticmethod
    def _steps_triton(x, dt, rec_pool, params, shape, batch, verify):
        from ..ops.mamba2_triton import mamba2_steps

        return mamba2_steps(x, dt, params.A_log, params.D, params.dt_bias, rec_pool, batch.state_slots,
                            shape.num_heads, shape.head_dim, shape.n_groups, shape.state_size,
                            batch.tokens_per_row, verify, out_dtype=x.dtype)

    def commit_verified(self, state_slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a verify: each row's conv window and state at its last accepted step into its slot."""
        commit_checkpoints(self.state_pool, state_slots, accepted)
