"""Sizing and allocating every cache from one memory budget. The only module that allocates cache memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig, ModelConfig
from .kv_pool import KVPool
from .req_slots import ReqSlots
from .state_pool import StatePool


def positions_ahead(k: int) -> int:
    """The KV positions a decoding request reserves past its last token with ``k`` speculative tokens: a verify
    row feeds positions c..c+k, and the k - 1 drafts chained after it reach c + 2k - 1."""
    return 2 * k


_GIB = 1 << 30
CPU_DEFAULT_BUDGET_GB = 2.0
CUDA_FREE_FRACTION = 0.9
CUDA_ACTIVATION_RESERVE_GB = 2.0


# Prefix-cache snapshots by default: up to this many per request slot, within this share of the cache budget
SNAPSHOTS_PER_SEQ = 2
SNAPSHOT_BUDGET_SHARE = 0.25


@dataclass
class Caches:
    req_slots: ReqSlots
    kv_pool: KVPool
    state_pool: StatePool
    max_model_len: int
    snapshot_slots: int = 0  # state slots beyond the live requests', for prefix-cache snapshots
    slot_bytes: int = 0  # one state slot (all linear layers)

    def summary(self) -> str:
        mib = 1 << 20
        text = (f"caches: {self.req_slots.max_num_seqs} request slots, "
                f"KV pool {self.kv_pool.num_tokens} tokens ({self.kv_pool.bytes / mib:.1f} MiB), "
                f"state pool {self.state_pool.num_slots} slots ({self.state_pool.bytes / mib:.1f} MiB), "
                f"max_model_len {self.max_model_len}")
        if self.snapshot_slots:
            text += (f"; prefix cache: up to {self.snapshot_slots} state snapshots of "
                     f"{self.slot_bytes / mib:.1f} MiB each, KV shared with the pool")
        return text


def _budget_bytes(ec: EngineConfig, device: torch.device) -> int:
    if ec.memory_budget_gb is not None:
        return int(ec.memory_budget_gb * _GIB)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(int(free * CUDA_FREE_FRACTION - CUDA_ACTIVATION_RESERVE_GB * _GIB), 0)
    return int(CPU_DEFAULT_BUDGET_GB * _GIB)


def _free_bytes(device: torch.device) -> int | None:
    """The memory free on ``device`` now (on the CPU the host's available memory), or None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:  # Linux's estimate of what can be allocated without swapping (free memory plus reclaimable caches)
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class CachePlan:
    """The caches' sizes for a model and engine config (``plan_caches``), before anything is allocated."""

    n_lin: int  # linear-attention layers (their state slots)
    n_attn: int  # attention layers with KV, the MTP head's included
    dims: tuple  # ``ModelConfig.state_dims``
    state_dtype: torch.dtype
    spec_tokens: int  # k (0: no speculation)
    keep_inputs: bool  # a verify keeps its steps' inputs (the replay commit) rather than each step's state
    kv_tokens: int
    snapshots: int  # state slots for prefix-cache snapshots
    slot_bytes: int  # one state slot (all linear layers)
    max_model_len: int


def plan_caches(mc: ModelConfig, ec: EngineConfig, dtype: torch.dtype, device: torch.device,
                extra_attn_layers: int = 0) -> CachePlan:
    """Size the state pool (and, with speculative decoding, its verify buffers: k + 1 steps per request) for
    ``max_num_seqs`` requests and the prefix cache's snapshots, and give the KV pool the rest of the budget; a
    ValueError naming what to change where they do not fit (the budget, the device's free memory, max_model_len).

    ``extra_attn_layers``: KV layers beyond the model's attention layers (the MTP head's).
    """
    state_dtype = getattr(torch, ec.state_dtype)
    k = ec.spec_tokens
    n_lin, n_attn = len(mc.linear_layer_ids), len(mc.attn_layer_ids) + extra_attn_layers
    dims = mc.state_dims  # (conv channels, conv kernel, heads, and the recurrent state's two dims per head)
    slot_bytes = StatePool.bytes_per_slot(n_lin, *dims, dtype, state_dtype)
    keep_inputs = ec.spec_commit == "replay" and mc.mamba is None  # the replay commit is GDN's; Mamba2 keeps states
    verify_bytes = StatePool.verify_bytes_per_row(n_lin, *dims, dtype, state_dtype, k + 1, keep_inputs) if k else 0
    budget = _budget_bytes(ec, device)
    snapshots = 0
    if ec.enable_prefix_caching:
        share = int(SNAPSHOT_BUDGET_SHARE * budget) // max(slot_bytes, 1)
        snapshots = (ec.prefix_snapshots if ec.prefix_snapshots is not None
                     else min(SNAPSHOTS_PER_SEQ * ec.max_num_seqs, share))
    state_bytes = ec.max_num_seqs * (slot_bytes + verify_bytes) + snapshots * slot_bytes
    kv_bytes_per_token = 2 * n_attn * mc.num_key_value_heads * mc.head_dim * torch.finfo(dtype).bits // 8
    if ec.max_model_len is not None and ec.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={ec.max_model_len} is more than the model's limit "
                         f"(max_position_embeddings={mc.max_position_embeddings})")
    len_limit = min(ec.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)

    if ec.kv_cache_tokens is not None:
        kv_tokens = ec.kv_cache_tokens
    else:
        if state_bytes >= budget:
            parts = [f"{ec.max_num_seqs} request slots"]
            if k:
                parts.append(f"the verify states of {k} speculative tokens per slot ({ec.max_num_seqs} x "
                             f"{verify_bytes / _GIB:.3f} GiB)")
            if snapshots:
                parts.append(f"{snapshots} prefix snapshots ({snapshots * slot_bytes / _GIB:.2f} GiB)")
            raise ValueError(
                f"the state pool ({', '.join(parts)}) needs {state_bytes / _GIB:.2f} GiB, more than the cache "
                f"budget of {budget / _GIB:.2f} GiB: lower max_num_seqs"
                + (", num_speculative_tokens" if k else "") + (" or prefix_snapshots" if snapshots else "")
                + ", or raise memory_budget_gb")
        kv_tokens = (budget - state_bytes) // max(kv_bytes_per_token, 1)
        # no more than every slot at the context limit, with the positions its drafts reserve past it
        kv_tokens = int(min(kv_tokens, ec.max_num_seqs * (len_limit + positions_ahead(k))))
    need = kv_tokens * kv_bytes_per_token + state_bytes
    free = _free_bytes(device)
    if free is not None and need > free:  # an explicit kv_cache_tokens (or a budget) past what the device has
        raise ValueError(f"the caches need {need / _GIB:.1f} GiB (a KV pool of {kv_tokens} tokens and the state "
                         f"pool), more than the {free / _GIB:.1f} GiB free on {device}: lower kv_cache_tokens, "
                         f"memory_budget_gb or max_num_seqs")
    ahead = positions_ahead(k)  # a request at the limit still reserves its draft positions past it
    if ec.max_model_len is not None and ec.max_model_len + ahead > kv_tokens:
        raise ValueError(f"max_model_len={ec.max_model_len} does not fit the KV pool of {kv_tokens} tokens"
                         + (f" with the {ahead} positions {k} speculative tokens reserve past it" if k else "")
                         + ": raise memory_budget_gb / kv_cache_tokens or lower max_model_len")
    max_model_len = min(len_limit, kv_tokens)
    if max_model_len < 2:
        raise ValueError(f"the KV pool holds only {kv_tokens} tokens: raise memory_budget_gb or kv_cache_tokens")
    if k and kv_tokens < max_model_len + ahead:  # (a limit from the pool's size: it leaves room for them)
        max_model_len = kv_tokens - ahead
        if max_model_len < 2:
            raise ValueError(f"the KV pool of {kv_tokens} tokens is too small for {k} speculative tokens")
    return CachePlan(n_lin, n_attn, dims, state_dtype, k, keep_inputs, kv_tokens, snapshots, slot_bytes,
                     max_model_len)


def allocate_caches(mc: ModelConfig, ec: EngineConfig, dtype: torch.dtype, device: torch.device,
                    extra_attn_layers: int = 0) -> Caches:
    """The caches ``plan_caches`` sizes, allocated on ``device``."""
    plan = plan_caches(mc, ec, dtype, device, extra_attn_layers)
    k, seqs = plan.spec_tokens, ec.max_num_seqs
    caches = Caches(
        # columns past max_model_len: positions a verify pass and its drafts reserve ahead of the last token
        req_slots=ReqSlots(seqs, plan.max_model_len + positions_ahead(k) + 1, device),
        kv_pool=KVPool(plan.n_attn, plan.kv_tokens, mc.num_key_value_heads, mc.head_dim, dtype, device),
        state_pool=StatePool(plan.n_lin, seqs + plan.snapshots, *plan.dims, dtype, plan.state_dtype, device),
        max_model_len=plan.max_model_len,
        snapshot_slots=plan.snapshots,
        slot_bytes=plan.slot_bytes,
    )
    if k:
        caches.state_pool.alloc_verify_buffers(seqs, k + 1, plan.keep_inputs, dtype)
    return caches
