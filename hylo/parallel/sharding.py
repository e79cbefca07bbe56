"""Tensor-parallel sharding of the GDN hybrids (Qwen3-Next, Qwen3.5): each rank's config (its share of the heads and intermediate sizes) and a
reader that hands each rank only its slice of every checkpoint tensor, so no rank ever holds the whole model.

The split, by tensor (``r`` = rank, ``n`` = tensor_parallel_size):
- attention: q_proj rows by query head (query and gate are interleaved per head), k/v_proj rows by KV head (with
  fewer KV heads than ranks, rank r keeps KV head ``r * kv // n``: replicated), o_proj columns (row-parallel; its
  bias only on rank 0); q/k norms replicated.
- Gated DeltaNet: in_proj_qkvz / in_proj_ba rows by key-head group (both are grouped per key head on disk; Qwen3.5's
  in_proj_qkv like the conv1d, its in_proj_z / b / a by value head), the conv1d channels of the rank's q, k and v
  heads, A_log / dt_bias by value head, out_proj columns.
- MLP and every expert: gate/up rows and down columns by intermediate slice (fused experts likewise, along their
  second and third dimensions); the router and the shared-expert gate replicated.
- embed_tokens and lm_head by vocabulary rows; norms and the MTP head's fc replicated.
After a row-parallel projection (o_proj, out_proj, down) each rank holds a partial sum: the decoder layer
all-reduces it.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from ..config import ModelConfig
from ..layers.weights import ReaderOver, TensorReader


def check_divisible(mc: ModelConfig, n: int) -> None:
    if mc.mamba is not None and n > 1:
        raise ValueError(f"{mc.model_type} models (Mamba2 hybrids) do not run with tensor parallelism yet: use "
                         f"tensor_parallel_size=1")
    problems = []
    for name in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads", "vocab_size",
                 "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(mc, name)
        if value % n:
            problems.append(f"{name}={value}")
    kv = mc.num_key_value_heads
    if kv % n and n % kv:
        problems.append(f"num_key_value_heads={kv}")
    if problems:
        raise ValueError(f"tensor_parallel_size={n} does not divide this model: {', '.join(problems)} "
                         f"(each must be a multiple of it; KV heads may also divide it)")


def local_config(mc: ModelConfig, n: int) -> ModelConfig:
    """The config of one rank's shard: what its layers, KV pool and state pool are sized from."""
    if n == 1:
        return mc
    check_divisible(mc, n)
    return replace(mc, num_attention_heads=mc.num_attention_heads // n,
                   num_key_value_heads=max(1, mc.num_key_value_heads // n),
                   linear_num_key_heads=mc.linear_num_key_heads // n,
                   linear_num_value_heads=mc.linear_num_value_heads // n,
                   intermediate_size=mc.intermediate_size // n, moe_intermediate_size=mc.moe_intermediate_size // n,
                   shared_expert_intermediate_size=mc.shared_expert_intermediate_size // n,
                   vocab_size=mc.vocab_size // n)


class ShardedReader(ReaderOver):
    """Wraps a reader; ``get`` returns this rank's slice, read piece by piece (a safetensors file is read only where
    the slice lies), checked against the shape the rank's layer expects."""

    def __init__(self, inner: TensorReader, mc: ModelConfig, rank: int, size: int):
        super().__init__(inner)
        self.mc, self.rank, self.size = mc, rank, size

    def scale_maps(self):
        """The inner reader's scale maps, sliced as the values are."""
        maps = self.inner.scale_maps()
        return None if maps is None else ShardedReader(maps, self.mc, self.rank, self.size)

    def get(self, name: str, shape=None) -> torch.Tensor:
        pieces = self._plan(name)
        if pieces is None:
            t = self.inner.get(name)
        elif pieces == "zeros":
            t = torch.zeros(self.inner.shape_of(name))
            self.used.add(name)
        else:
            parts = [self.inner.get_part(name, dim, a, b) for dim, a, b in pieces]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0][0])
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name!r}: rank {self.rank}'s slice has shape {list(t.shape)}, "
                             f"expected {list(shape)}")
        return t

    def _plan(self, name: str):
        """How this rank reads ``name``: None (whole, replicated), "zeros", or [(dim, start, stop), ...] pieces
        concatenated along their dim."""
        r, n, mc = self.rank, self.size, self.mc
        if not self.inner.has(name):
            return None  # let the inner reader name the missing tensor
        full = self.inner.shape_of(name)

        def rows(lo=0, hi=None):  # this rank's share of rows [lo, hi)
            hi = full[0] if hi is None else hi
            size = (hi - lo) // n
            return (0, lo + r * size, lo + (r + 1) * size)

        def cols():
            size = full[1] // n
            return [(1, r * size, (r + 1) * size)]

        leaf = name.rsplit(".", 2)
        if re.search(r"(embed_tokens|lm_head)\.weight$", name):
            return [rows()]
        if ".self_attn." in name:
            kind = leaf[-2]
            if kind == "q_proj":
                return [rows()]
            if kind in ("k_proj", "v_proj"):
                kv = mc.num_key_value_heads
                if kv >= n:
                    return [rows()]
                d = full[0] // kv
                head = r * kv // n  # fewer KV heads than ranks: replicated
                return [(0, head * d, (head + 1) * d)]
            if kind == "o_proj":
                if name.endswith("weight"):
                    return cols()
                return None if r == 0 else "zeros"  # the bias is added once, after the all-reduce sum
            return None  # q_norm, k_norm
        if ".linear_attn." in name:
            kind = leaf[-2] if name.endswith("weight") else leaf[-1]
            if kind in ("in_proj_qkvz", "in_proj_ba", "A_log", "dt_bias"):
                return [rows()]  # grouped by key head on disk; value heads follow their key head
            if kind in ("in_proj_z", "in_proj_b", "in_proj_a"):
                return [rows()]  # by value head, in order: rank r's value heads follow its key heads
            if kind in ("conv1d", "in_proj_qkv"):  # [q | k | v] of all heads
                kd, vd = mc.linear_key_dim, mc.linear_value_dim
                return [rows(0, kd), rows(kd, 2 * kd), rows(2 * kd, 2 * kd + vd)]
            if kind == "out_proj":
                return cols()
            return None  # the gated norm's weight
        if name.endswith("experts.gate_up_proj"):  # fused experts [E, 2I, H]: the gate rows, then the up rows
            inter = full[1] // 2
            return [(1, lo + r * (inter // n), lo + (r + 1) * (inter // n)) for lo in (0, inter)]
        if name.endswith("experts.down_proj"):  # fused experts [E, H, I]
            return [(2, r * (full[2] // n), (r + 1) * (full[2] // n))]
        if re.search(r"(gate_proj|up_proj)\.weight$", name):
            return [rows()]
        if name.endswith("down_proj.weight"):
            return cols()
        return None  # norms, the router, the shared-expert gate, the MTP head's fc
