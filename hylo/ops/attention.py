"""Causal attention over the paged KV pool (page size 1: ``req_to_token[req_slot, pos]`` is a token location).

GQA: query head h reads KV head ``h // (H / KVH)``. Scores and softmax in float32.
"""

from __future__ import annotations

import torch

from .triton_utils import use_triton


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Write new keys/values ([T, KVH, D]) at their pool locations ([T]) of one layer's cache ([N, KVH, D]); on
    CUDA one launch for both (the values may be read in place from a wider projection)."""
    if use_triton(k) and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype:
        from .attention_triton import store_kv_triton

        if store_kv_triton(k_cache, v_cache, loc, k, v):
            return
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's ``out * sigmoid(gate)`` (sigmoid rounded to out's dtype first, as torch computes it):
    out [T, H, D], gate [T, H * D] (rows may be strided: a slice of the qkv projection). One Triton pass on CUDA."""
    tokens = out.shape[0]
    if use_triton(out):
        from .linear_triton import sigmoid_gate

        return sigmoid_gate(out.reshape(tokens, -1), gate).view(out.shape)
    return (out.reshape(tokens, -1) * torch.sigmoid(gate)).view(out.shape)


def _attend(q, k, v, mask, scaling):
    """q: [..., H, Lq, D]; k, v: [..., KVH, Lk, D]; mask: broadcastable bool [..., 1, Lq, Lk] (True = keep)."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    group = heads // kv_heads
    qg = q.float().unflatten(-3, (kv_heads, group))  # [..., KVH, G, Lq, D]
    scores = (qg @ k.float().unsqueeze(-3).transpose(-1, -2)) * scaling  # [..., KVH, G, Lq, Lk]
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    probs = scores.softmax(-1)
    out = probs @ v.float().unsqueeze(-3)  # [..., KVH, G, Lq, D]
    return out.flatten(-4, -3)  # [..., H, Lq, D]


def _extend_rows(q, k_cache, v_cache, req_to_token, req_slots_cpu, prefix_lens_cpu, extend_lens_cpu, rows=None):
    """Per prefill row (all, or ``rows``): its first token in ``q``, its length, its queries [H, L, D], the keys and
    values of its whole context [KVH, P + L, D], and the mask over that context [L, P + L] (True: attend), None
    where the row has no cached prefix (plain causal: no mask built, which at 8192 tokens would be 64 MB)."""
    starts = [0]
    for length in extend_lens_cpu:
        starts.append(starts[-1] + length)
    for i in range(len(extend_lens_cpu)) if rows is None else rows:
        slot, prefix, length, start = req_slots_cpu[i], prefix_lens_cpu[i], extend_lens_cpu[i], starts[i]
        total = prefix + length
        locs = req_to_token[slot, :total]
        mask = None
        if prefix:
            q_pos = torch.arange(prefix, total, device=q.device)
            mask = q_pos[:, None] >= torch.arange(total, device=q.device)[None, :]
        yield (start, length, q[start:start + length].transpose(0, 1), k_cache[locs].transpose(0, 1),
               v_cache[locs].transpose(0, 1), mask)


def extend_attention_ref(q, k_cache, v_cache, req_to_token, req_slots_cpu, prefix_lens_cpu, extend_lens_cpu,
                         scaling):
    """Prefill chunks of several requests, each attending to its cached prefix and causally to itself.

    q: [T, H, D] packed by request; the new keys/values must already be in the cache.
    Returns [T, H, D] in q's dtype.
    """
    out = torch.empty_like(q)
    for start, length, qi, k, v, mask in _extend_rows(q, k_cache, v_cache, req_to_token, req_slots_cpu,
                                                      prefix_lens_cpu, extend_lens_cpu):
        if mask is None:
            mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        out[start:start + length] = _attend(qi, k, v, mask[None], scaling).transpose(0, 1).to(q.dtype)
    return out


def decode_attention_ref(q, k_cache, v_cache, req_to_token, req_slots, seq_lens, max_seq_len: int, scaling,
                         tokens_per_row: int = 1):
    """Decode (one query per row) or verify (``tokens_per_row`` consecutive queries per row) for a batch.

    q: [B * tokens_per_row, H, D]; seq_lens: [B] cache length after this pass, the last ``tokens_per_row``
    positions being the new tokens. ``max_seq_len`` is a host upper bound of seq_lens: nothing is read back.
    """
    batch = req_slots.shape[0]
    s = tokens_per_row
    key_pos = torch.arange(max_seq_len, device=q.device)
    # positions past a row's length hold stale locations (whatever owned the slot before): never read them, not
    # even to mask them afterwards (0 * NaN is NaN)
    valid = (key_pos[None, :] < seq_lens[:, None])[:, None, :, None]  # [B, 1, Lk, 1]
    locs = req_to_token[req_slots, :max_seq_len]  # [B, Lk]
    k = k_cache[locs].transpose(1, 2).where(valid, 0.0)  # [B, KVH, Lk, D]
    v = v_cache[locs].transpose(1, 2).where(valid, 0.0)
    qb = q.view(batch, s, *q.shape[1:]).transpose(1, 2)  # [B, H, s, D]
    q_pos = seq_lens[:, None] - s + torch.arange(s, device=q.device)[None, :]  # [B, s]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, s, Lk]
    out = _attend(qb, k, v, mask[:, None], scaling)  # [B, H, s, D]
    return out.transpose(1, 2).reshape(q.shape).to(q.dtype)


# Whether torch's fused attention takes K/V with fewer heads than the queries (``enable_gqa``) in a fused kernel
# (cuDNN or flash), by (device, dtype, heads, KV heads, head size, masked): probed on the first call of each kind
# (float32 has no fused kernel at all; a verdict for one kind says nothing about another). Without it the K/V
# heads are repeated first, which at an 8192-token prefill of bench-6b writes 2 x 67 MB per attention layer
# (1.0 ms over its 6 layers on the H200, run -1322).
_GQA_FUSED: dict[tuple, bool] = {}


def _sdpa(q, k, v, mask, scaling):
    """q [1, H, Lq, D]; k, v [1, KVH, Lk, D]; mask None (causal, Lq == Lk) or bool [Lq, Lk] (True = keep)."""
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads = q.shape[1], k.shape[1]
    kw = dict(attn_mask=mask, is_causal=mask is None, scale=scaling)
    if heads != kv_heads and q.is_cuda:
        key = (str(q.device), q.dtype, heads, kv_heads, q.shape[-1], mask is not None)
        if _GQA_FUSED.get(key, True):
            try:  # fused kernels only: never the math fallback, which would materialise every score
                with warnings.catch_warnings(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                    warnings.simplefilter("ignore")
                    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
                _GQA_FUSED[key] = True
                return out
            except torch.OutOfMemoryError:  # a transient shortage says nothing of the kernels: not remembered
                raise
            except (RuntimeError, TypeError, AttributeError):  # no such kernel here, or a torch before enable_gqa
                _GQA_FUSED[key] = False
    if heads != kv_heads:
        k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, **kw)


def extend_attention_sdpa(q, k_cache, v_cache, req_to_token, req_slots_cpu, prefix_lens_cpu, extend_lens_cpu,
                          scaling, rows: list[int] | None = None, out: torch.Tensor | None = None):
    """The same as :func:`extend_attention_ref` through torch's fused scaled-dot-product attention (cuDNN or flash
    kernels on CUDA, reading the K/V heads shared by several query heads as they are), row by row; ``rows``: only
    these rows (into ``out``, whose other rows are left as they are)."""
    out = torch.empty_like(q) if out is None else out
    for start, length, qi, k, v, mask in _extend_rows(q, k_cache, v_cache, req_to_token, req_slots_cpu,
                                                      prefix_lens_cpu, extend_lens_cpu, rows):
        qi, k, v = qi[None], k[None], v[None]  # [1, H, L, D], [1, KVH, P + L, D]
        out[start:start + length] = _sdpa(qi, k, v, mask, scaling)[0].transpose(0, 1)
    return out
