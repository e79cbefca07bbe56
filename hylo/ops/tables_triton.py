"""The two ends of a captured decoding step, each one launch (Triton): the prologue that builds the step's batch
from the device request tables, and the greedy epilogue that picks each row's token and records it.

At batch 1 a decode step of bench-6b is about 1.7 ms, and these ends took 13 small torch launches before the model
(index writes, gathers, additions: about 27 us with their gaps) and an argmax plus two index writes after it
(about 12 us). The torch forms stay the reference: ``ModelWorker.table_batch`` and ``ReqSlots.record`` with
``argmax``, which the tests compare these against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TABLE_BLOCK = 128  # rows (and KV triples) per iteration of the prologue's single program


@triton.jit
def _table_batch_kernel(req_ptr, trip_ptr, W, seq_len_ptr, last_ptr, r2t_ptr, drafts_ptr, ids_ptr, pos_ptr,
                        lens_ptr, qsl_ptr, loc_ptr, B, stride_r2t, stride_d, N: tl.constexpr,
                        HAS_DRAFTS: tl.constexpr, BLOCK: tl.constexpr):
    """One program. First the step's new KV locations, ``req_to_token[row, col] = loc`` for W (row, col, loc)
    triples; then, after a barrier that makes those writes visible to the whole program, each of the B rows of
    request slot s: its N positions from the committed length (0 for s = 0, the padding row), its KV locations
    read back from ``req_to_token``, its fed tokens (the newest token, then the drafts ``drafts[s]``), its new
    length and its query offset."""
    i0 = 0
    while i0 < W:  # while loops: the interpreter cannot run a for loop with run-time bounds
        i = i0 + tl.arange(0, BLOCK)
        m = i < W
        r = tl.load(trip_ptr + i, mask=m, other=0)
        c = tl.load(trip_ptr + W + i, mask=m, other=0)
        loc = tl.load(trip_ptr + 2 * W + i, mask=m, other=0)
        tl.store(r2t_ptr + r * stride_r2t + c, loc, mask=m)
        i0 += BLOCK
    tl.debug_barrier()
    b0 = 0
    while b0 < B:
        b = b0 + tl.arange(0, BLOCK)
        m = b < B
        slot = tl.load(req_ptr + b, mask=m, other=0)
        base = tl.where(slot == 0, 0, tl.load(seq_len_ptr + slot, mask=m, other=0))
        tl.store(lens_ptr + b, base + N, mask=m)
        tl.store(qsl_ptr + b, b.to(tl.int64) * N, mask=m)
        for j in tl.static_range(N):
            t = b.to(tl.int64) * N + j
            tl.store(pos_ptr + t, base + j, mask=m)
            # .cg: past L1, which the barrier does not make coherent with this program's own writes above
            tl.store(loc_ptr + t, tl.load(r2t_ptr + slot * stride_r2t + base + j, mask=m, other=0,
                                          cache_modifier=".cg"), mask=m)
            if j == 0:
                tl.store(ids_ptr + t, tl.load(last_ptr + slot, mask=m, other=0), mask=m)
            elif HAS_DRAFTS:
                tl.store(ids_ptr + t, tl.load(drafts_ptr + slot * stride_d + (j - 1), mask=m, other=0), mask=m)
            else:  # no drafts table: the caller feeds tokens of its own
                tl.store(ids_ptr + t, tl.zeros_like(slot), mask=m)
        b0 += BLOCK
    tl.store(qsl_ptr + B, B * N)  # B may be the constant 1 (Triton specialises it): no tensor methods


def table_batch(req_to_token: torch.Tensor, seq_len: torch.Tensor, last_token: torch.Tensor,
                req_slots: torch.Tensor, n: int, drafts: torch.Tensor | None = None,
                kv: torch.Tensor | None = None):
    """Rows of request slots ``req_slots`` [B] feeding ``n`` tokens each, after writing the KV triples ``kv``
    [3, W] (rows, columns, locations) into ``req_to_token``. ``drafts`` [S, n - 1] (when n > 1; without it a row's
    tokens after its newest are 0, for a caller that feeds its own). Returns (input_ids, positions,
    out_cache_loc) [B * n] and (seq_lens [B], query_start_loc [B + 1]), all int64."""
    bs, dev = req_slots.shape[0], req_slots.device
    out = torch.empty(4 * bs * n + 2 * bs + 1, dtype=torch.int64, device=dev)
    ids, pos, loc = out[:3 * bs * n].view(3, bs * n)
    lens, qsl = out[3 * bs * n:3 * bs * n + bs], out[3 * bs * n + bs:3 * bs * n + 2 * bs + 1]
    w = kv.shape[1] if kv is not None else 0
    _table_batch_kernel[(1,)](req_slots, kv if kv is not None else req_slots, w, seq_len, last_token, req_to_token,
                              drafts if drafts is not None else last_token, ids, pos, lens, qsl, loc, bs,
                              req_to_token.stride(0), drafts.stride(0) if drafts is not None else 0, N=n,
                              HAS_DRAFTS=drafts is not None, BLOCK=TABLE_BLOCK, num_warps=4)
    return ids, pos, loc, lens, qsl


@triton.jit
def _greedy_kernel(logits_ptr, stride_l, V, req_ptr, lens_ptr, tok_ptr, last_ptr, seq_len_ptr, best_ptr, count_ptr,
                   BV: tl.constexpr, RECORD: tl.constexpr):
    """Program (row, block of BV columns): the block's best column goes into the row's packed key by an atomic
    max (the value's order-preserving int32 bits, then the column counted down from 2^31 - 1, so that of equal
    values the first column wins, as in ``argmax``); the row's last program to finish unpacks the key, resets it
    and the counter for the next launch, and writes the token to ``tok``. With RECORD, also to the request tables
    (its newest token and committed length; the padding row, request slot 0, writes nothing)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BV + tl.arange(0, BV)
    m = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=m, other=float("-inf")).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == 0.0 in argmax: one key for both
    x = tl.where(x != x, float("nan"), x)  # every NaN as the positive one, above +inf (argmax returns a NaN)
    bits = x.to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of the bits = order of the values
    key = (order.to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    key = tl.where(m, key, -0x7FFFFFFFFFFFFFFF - 1)
    tl.atomic_max(best_ptr + row, tl.max(key, 0))
    if tl.atomic_add(count_ptr + row, 1) == tl.num_programs(1) - 1:  # acq_rel: every other block's max is in
        best = tl.atomic_xchg(best_ptr + row, -0x7FFFFFFFFFFFFFFF - 1)
        tl.atomic_xchg(count_ptr + row, 0)
        tok = 0x7FFFFFFF - (best & 0xFFFFFFFF)
        tl.store(tok_ptr + row, tok)
        if RECORD:
            slot = tl.load(req_ptr + row)
            if slot != 0:
                tl.store(last_ptr + slot, tok)
                tl.store(seq_len_ptr + slot, tl.load(lens_ptr + row))


GREEDY_BLOCK = 1024  # columns per program: about 150 programs per row at a 152k vocabulary
_SCRATCH: dict = {}  # device -> (packed keys, block counters) per row, left in their reset state by every launch


def _scratch(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row scratch, allocated once per device (at the first, eager, launch: a graph's warm-up run comes
    before its capture), for at least ``rows`` rows."""
    have = _SCRATCH.get(device)
    if have is None or have[0].shape[0] < rows:
        n = max(rows, 4096)
        have = _SCRATCH[device] = (torch.full((n,), -(1 << 63), dtype=torch.int64, device=device),
                                   torch.zeros(n, dtype=torch.int32, device=device))
    return have


def _greedy(logits, record=None) -> torch.Tensor:
    rows, v = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        best, count = _scratch(rows, logits.device)
        req, lens, last, seq_len = record if record is not None else (tokens,) * 4
        _greedy_kernel[(rows, triton.cdiv(v, GREEDY_BLOCK))](logits, logits.stride(0), v, req, lens, tokens, last,
                                                             seq_len, best, count, BV=GREEDY_BLOCK,
                                                             RECORD=record is not None, num_warps=4)
    return tokens


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of [B, V] (float32 or 16-bit, unit column stride) in one launch over about V / 1024
    programs per row (torch's reduction took 8.3 us for one bench-6b row on the H200)."""
    return _greedy(logits)


def greedy_record(logits: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor, last_token: torch.Tensor,
                  seq_len: torch.Tensor) -> torch.Tensor:
    """:func:`argmax`, recorded as ``ReqSlots.record(req_slots, seq_lens, req_slots, tokens)`` does (except for
    request slot 0, the padding row, whose table entries are never read), in the same launch. Returns the tokens."""
    return _greedy(logits, (req_slots, seq_lens, last_token, seq_len))


@triton.jit
def _accept_kernel(best_ptr, ids_ptr, forced_ptr, req_ptr, lens_ptr, last_ptr, seq_len_ptr, acc_ptr, emitted_ptr,
                   packed_ptr, samp_ptr, eos_ptr, B, K: tl.constexpr, BK: tl.constexpr, FORCED: tl.constexpr,
                   LIMIT: tl.constexpr, NUM_EOS: tl.constexpr, SAMP: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [BLOCK] of a greedy verify: a = the drafts (the fed tokens after the first) that match the target's
    argmax before the first mismatch, or ``forced[row]`` (simulated acceptance), at most the row's limit
    (``speculative.verify.accept_limit``: its max_tokens, and the first end-of-sequence token among the emitted ones
    unless it ignores them); the emitted tokens are the drafts before position a and the target's tokens from it;
    then the tables (newest token best[a], committed length seq_len - K + a; not for request slot 0) and the host's
    packed row (emitted, a + 1)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = rows < B
    cols = tl.arange(0, BK)
    r = rows.to(tl.int64)[:, None]
    best = tl.load(best_ptr + r * (K + 1) + cols[None, :], mask=m[:, None] & (cols < K + 1)[None, :], other=0)
    drafts = tl.load(ids_ptr + r * (K + 1) + 1 + cols[None, :], mask=m[:, None] & (cols < K)[None, :], other=-1)
    if FORCED:
        a = tl.load(forced_ptr + rows, mask=m, other=0)
    else:  # the first column that does not match (columns from K on never do)
        a = tl.min(tl.where((drafts == best) & (cols < K)[None, :], K, cols[None, :]), 1).to(tl.int64)
    emitted = tl.where(cols[None, :] < a[:, None], drafts, best)
    # the row's limit: its max_tokens, and its first end-of-sequence token (sampling_i: top_k, seed, prompt length,
    # max_tokens, stops on EOS); a smaller a keeps emitted[:a + 1] (the token at a is the target's then, too)
    slot = tl.load(req_ptr + rows, mask=m, other=0)
    lens = tl.load(lens_ptr + rows, mask=m, other=0)
    if LIMIT:  # a = -1: the row's request had ended before this step, which then commits nothing for it
        srow = slot.to(tl.int64) * SAMP
        done = lens - K - tl.load(samp_ptr + srow + 2, mask=m, other=0)
        limit = tl.minimum(tl.maximum(tl.load(samp_ptr + srow + 3, mask=m, other=0) - done - 1, -1), K)
        if NUM_EOS > 0:
            stops = tl.load(samp_ptr + srow + 4, mask=m, other=0) > 0
            fed = tl.load(ids_ptr + rows.to(tl.int64) * (K + 1), mask=m, other=-1)
            is_eos = tl.zeros([BLOCK, BK], dtype=tl.int1)
            fed_eos = tl.zeros([BLOCK], dtype=tl.int1)
            for j in tl.static_range(NUM_EOS):
                e = tl.load(eos_ptr + j)
                is_eos = is_eos | (emitted == e)
                fed_eos = fed_eos | (fed == e)
            is_eos = is_eos & stops[:, None] & (cols < K)[None, :]
            limit = tl.minimum(limit, tl.min(tl.where(is_eos, cols[None, :], K), 1).to(tl.int64))
            limit = tl.where(fed_eos & stops, -1, limit)
        a = tl.minimum(a, limit)
    mo = m[:, None] & (cols < K + 1)[None, :]
    tl.store(emitted_ptr + r * (K + 1) + cols[None, :], emitted, mask=mo)
    tl.store(packed_ptr + r * (K + 2) + cols[None, :], emitted, mask=mo)
    tl.store(packed_ptr + rows.to(tl.int64) * (K + 2) + K + 1, a + 1, mask=m)
    tl.store(acc_ptr + rows, a, mask=m)
    tok = tl.sum(tl.where(cols[None, :] == a[:, None], emitted, 0), 1)
    real = m & (slot != 0) & (a >= 0)  # an inert row leaves its tables as they were
    tl.store(last_ptr + slot, tok, mask=real)
    tl.store(seq_len_ptr + slot, lens - K + a, mask=real)


def accept_record(best: torch.Tensor, input_ids: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                  last_token: torch.Tensor, seq_len: torch.Tensor, forced: torch.Tensor | None = None,
                  sampling_i: torch.Tensor | None = None, eos: torch.Tensor | None = None):
    """A greedy verify's acceptance and bookkeeping in one launch, where ``greedy_accept``, the table writes of
    ``ReqSlots.record`` and the packing for the host took about a dozen. best: [B, k + 1] the target's argmax;
    input_ids: [B * (k + 1)] the fed tokens (newest, then the k drafts); seq_lens: [B] the lengths after the fed
    tokens; ``forced``: [B] accepted counts that replace the matching (simulated acceptance); ``sampling_i``
    (``ReqSlots.sampling_i``) and ``eos`` [E]: limit each row as ``speculative.verify.accept_limit`` does. Returns
    (emitted [B, k + 1], accepted [B], packed [B, k + 2]: emitted, then accepted + 1), int64."""
    rows, k1 = best.shape
    best = best.contiguous()
    emitted = torch.empty(rows, k1, dtype=torch.int64, device=best.device)
    packed = torch.empty(rows, k1 + 1, dtype=torch.int64, device=best.device)
    accepted = torch.empty(rows, dtype=torch.int64, device=best.device)
    if rows:
        block = 128
        limit = sampling_i is not None
        eos = eos if eos is not None and limit else best
        _accept_kernel[(triton.cdiv(rows, block),)](
            best, input_ids, forced if forced is not None else accepted, req_slots, seq_lens, last_token, seq_len,
            accepted, emitted, packed, sampling_i if limit else best, eos, rows, K=k1 - 1,
            BK=triton.next_power_of_2(k1), FORCED=forced is not None, LIMIT=limit,
            NUM_EOS=eos.numel() if limit else 0, SAMP=sampling_i.shape[1] if limit else 1, BLOCK=block, num_warps=4)
    return emitted, accepted, packed


# ---- an EXTEND step's inputs (engine/extend.py packs them; its expand_ref is the reference) ------------------------
# The packed tensor's header, as the kernels read it: [0] tokens T, [1] new locations W, [2] runs R, [3] rows B,
# then the offsets of the fields in engine.extend.FIELDS order: [4] tokens, [5] locs, [6] run_slot,
# [7] run_first, [8] run_start, [9] req, [10] state, [11] prefix, [12] qsl, [13] dev, ... (the rest is the host's)
@triton.jit
def _last_at_most(start_ptr, n, x, BLOCK: tl.constexpr):
    """For each x: the largest index j < n with start[j] <= x (start ascending, start[0] <= x): a branchless binary
    search, about log2(n) gathers."""
    lo = tl.zeros([BLOCK], tl.int64)
    size = n
    while size > 1:
        half = size // 2
        mid = lo + half
        lo = tl.where(tl.load(start_ptr + mid) <= x, mid, lo)
        size = size - half
    return lo


@triton.jit
def _extend_runs_kernel(meta_ptr, r2t_ptr, stride_r2t, BLOCK: tl.constexpr):
    """Program p: locations [p * BLOCK, (p + 1) * BLOCK) of the step's runs, req_to_token[slot, first + j] = loc."""
    w = tl.load(meta_ptr + 1)
    runs = tl.load(meta_ptr + 2)
    locs_ptr = meta_ptr + tl.load(meta_ptr + 5)
    slot_ptr = meta_ptr + tl.load(meta_ptr + 6)
    first_ptr = meta_ptr + tl.load(meta_ptr + 7)
    start_ptr = meta_ptr + tl.load(meta_ptr + 8)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = i < w
    r = _last_at_most(start_ptr, runs, i, BLOCK)
    col = tl.load(first_ptr + r, mask=m, other=0) + i - tl.load(start_ptr + r, mask=m, other=0)
    slot = tl.load(slot_ptr + r, mask=m, other=0)
    tl.store(r2t_ptr + slot * stride_r2t + col, tl.load(locs_ptr + i, mask=m, other=0), mask=m)


@triton.jit
def _extend_rows_kernel(meta_ptr, r2t_ptr, stride_r2t, last_ptr, out_ptr, BLOCK: tl.constexpr):
    """Program p: tokens [p * BLOCK, (p + 1) * BLOCK): each token's row (by its query offsets), position, KV
    location (read from req_to_token, after the runs kernel wrote the new ones), and input id (the host's, or the
    row's newest token from the device table where the row is a decoding one). Program 0 also writes the rows'
    lengths. ``out``: ids, positions, locations, rows [T] each, then lengths [B]."""
    t_all = tl.load(meta_ptr + 0)
    rows = tl.load(meta_ptr + 3)
    tok_ptr = meta_ptr + tl.load(meta_ptr + 4)
    req_ptr = meta_ptr + tl.load(meta_ptr + 9)
    prefix_ptr = meta_ptr + tl.load(meta_ptr + 11)
    qsl_ptr = meta_ptr + tl.load(meta_ptr + 12)
    dev_ptr = meta_ptr + tl.load(meta_ptr + 13)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = t < t_all
    row = _last_at_most(qsl_ptr, rows, t, BLOCK)
    pos = tl.load(prefix_ptr + row, mask=m, other=0) + t - tl.load(qsl_ptr + row, mask=m, other=0)
    slot = tl.load(req_ptr + row, mask=m, other=0)
    from_dev = tl.load(dev_ptr + row, mask=m, other=0) != 0
    ids = tl.where(from_dev, tl.load(last_ptr + slot, mask=m & from_dev, other=0),
                   tl.load(tok_ptr + t, mask=m, other=0))
    tl.store(out_ptr + t, ids, mask=m)
    tl.store(out_ptr + t_all + t, pos, mask=m)
    tl.store(out_ptr + 2 * t_all + t, tl.load(r2t_ptr + slot * stride_r2t + pos, mask=m, other=0), mask=m)
    tl.store(out_ptr + 3 * t_all + t, row, mask=m)
    if tl.program_id(0) == 0:
        b0 = 0
        while b0 < rows:
            b = b0 + tl.arange(0, BLOCK).to(tl.int64)
            mb = b < rows
            n = tl.load(qsl_ptr + b + 1, mask=mb, other=0) - tl.load(qsl_ptr + b, mask=mb, other=0)
            tl.store(out_ptr + 4 * t_all + b, tl.load(prefix_ptr + b, mask=mb, other=0) + n, mask=mb)
            b0 += BLOCK


EXTEND_BLOCK = 1024


def extend_tables(meta: torch.Tensor, t: int, w: int, b: int, req_to_token: torch.Tensor,
                  last_token: torch.Tensor):
    """``engine.extend.expand`` in two launches: ``meta`` is the packed step on the device (its header gives the
    kernels the sizes and the fields' offsets), with ``t`` tokens, ``w`` new locations and ``b`` rows."""
    out = torch.empty(4 * t + b, dtype=torch.int64, device=req_to_token.device)
    if w:
        _extend_runs_kernel[(triton.cdiv(w, EXTEND_BLOCK),)](meta, req_to_token, req_to_token.stride(0),
                                                             BLOCK=EXTEND_BLOCK, num_warps=4)
    _extend_rows_kernel[(triton.cdiv(t, EXTEND_BLOCK),)](meta, req_to_token, req_to_token.stride(0), last_token, out,
                                                         BLOCK=EXTEND_BLOCK, num_warps=4)
    ids, pos, loc, row = out[:4 * t].view(4, t)
    return ids, pos, loc, row, out[4 * t:]
