"""The captured step's two ends (ops/tables_triton.py) against their torch forms: the prologue that builds a batch
from the request tables (``ModelWorker.table_batch`` after ``ReqSlots.scatter_locations``) and the greedy
epilogue (``argmax``, then ``ReqSlots.record``)."""

import pytest
import torch

from hylo.cache.req_slots import ReqSlots


def _tables(dev, seqs=12, ctx=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = ReqSlots(seqs, ctx, dev)
    t.req_to_token[1:] = torch.randint(1, 1000, (seqs, ctx), generator=g).to(dev)
    t.seq_len[1:] = torch.randint(0, ctx - 10, (seqs,), generator=g).to(dev)
    t.last_token[:] = torch.randint(0, 500, (seqs + 1,), generator=g).to(dev)
    return t, g


@pytest.mark.parametrize("n,bs,pad", [(1, 1, 0), (1, 5, 3), (4, 7, 1), (3, 300, 0)])
def test_table_batch_kernel_equals_the_torch_prologue(dev, n, bs, pad):
    """Rows of n tokens (with drafts when n > 1), padded rows of request slot 0, new KV triples that the same
    launch must write before reading them back (some at the very positions the rows feed), and more rows than
    one block of the kernel (300)."""
    from hylo.engine.worker import ModelWorker
    from hylo.ops.tables_triton import table_batch

    seqs = max(12, bs)
    t, g = _tables(dev, seqs, seed=n * 1000 + bs)
    real = torch.randperm(seqs, generator=g)[:bs - pad] + 1
    req = torch.cat([real, torch.zeros(pad, dtype=torch.long)]).to(dev)
    drafts = torch.randint(0, 500, (seqs + 1, n - 1), generator=g).to(dev) if n > 1 else None
    # new locations at each real row's fed positions, and (0, 0, 0) padding triples
    rows = real.repeat_interleave(n)
    cols = (t.seq_len[real.to(dev)].cpu()[:, None] + torch.arange(n)[None, :]).reshape(-1)
    kv = torch.stack([rows, cols, torch.randint(5000, 6000, (rows.numel(),), generator=g)])
    kv = torch.cat([kv, torch.zeros(3, 4, dtype=torch.long)], 1).to(dev)

    ref_tables = ReqSlots(seqs, 64, dev)
    for name in ("req_to_token", "seq_len", "last_token"):
        getattr(ref_tables, name).copy_(getattr(t, name))
    ref_tables.scatter_locations(*kv)
    worker = ModelWorker.__new__(ModelWorker)  # table_batch needs only the tables and the device
    worker.caches = type("C", (), {"req_slots": ref_tables})()
    worker.device = torch.device(dev)
    ref = worker.table_batch(None, n, req, req, 64, drafts)

    ids, pos, loc, lens, qsl = table_batch(t.req_to_token, t.seq_len, t.last_token, req, n, drafts, kv)
    assert torch.equal(t.req_to_token, ref_tables.req_to_token)
    assert torch.equal(ids, ref.input_ids) and torch.equal(pos, ref.positions)
    assert torch.equal(loc, ref.out_cache_loc) and torch.equal(lens, ref.seq_lens)
    assert torch.equal(qsl, ref.query_start_loc)
    if n > 1:  # without a drafts table (a caller feeding its own tokens): the same batch, the drafts' ids zero
        ids2, pos2, loc2, _, _ = table_batch(t.req_to_token, t.seq_len, t.last_token, req, n)
        assert torch.equal(ids2.view(bs, n)[:, 0], ids.view(bs, n)[:, 0]) and not ids2.view(bs, n)[:, 1:].any()
        assert torch.equal(pos2, pos) and torch.equal(loc2, loc)


@pytest.mark.parametrize("rows,vocab,dtype", [(1, 3000, torch.bfloat16), (5, 1025, torch.float32),
                                               (3, 151936, torch.bfloat16)])
def test_greedy_record_equals_argmax_and_record(dev, rows, vocab, dtype):
    """The fused argmax picks argmax's column (ties to the first, negative and -0.0 values, a NaN) and writes the
    tables as ``record`` does; its scratch comes back reset, so further launches give the same again."""
    from hylo.ops.tables_triton import _SCRATCH, argmax, greedy_record

    t, g = _tables(dev, seed=rows)
    logits = (torch.randn(rows, vocab, generator=g) * 3 - 20).to(dtype)
    logits[0, vocab // 2] = logits[0, vocab // 3] = logits[0].max() + 1  # a tie: the first column wins
    if rows > 1:
        logits[1] = -0.0
        logits[1, 7] = 0.0  # all zeros of both signs: column 0
        logits[2, vocab - 1] = float("nan")
    logits = logits.to(dev)
    req = torch.tensor([3, 0, 5, 1, 2][:rows], device=dev)
    lens = torch.randint(1, 60, (rows,), generator=g).to(dev)
    ref = ReqSlots(12, 64, dev)
    ref.seq_len.copy_(t.seq_len)
    ref.last_token.copy_(t.last_token)
    expect = logits.argmax(-1)
    ref.record(req, lens, req, expect)
    for _ in range(2):
        tokens = greedy_record(logits, req, lens, t.last_token, t.seq_len)
        assert torch.equal(tokens, expect)
        assert torch.equal(t.last_token[1:], ref.last_token[1:]) and torch.equal(t.seq_len[1:], ref.seq_len[1:])
        assert torch.equal(argmax(logits), expect)
        best, count = _SCRATCH[logits.device]
        assert bool((best == -(1 << 63)).all()) and not bool(count.any())


def test_greedy_tokens_of_verify_shaped_logits(dev):
    """The speculative paths' argmax over [B, k + 1, V] logits (verify) and [B, V] (drafts), as torch's."""
    from hylo.ops.sampling import greedy_tokens

    logits = torch.randn(3, 4, 5000, generator=torch.Generator().manual_seed(3)).to(dev, torch.bfloat16)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert torch.equal(greedy_tokens(logits[:, 1]), logits[:, 1].argmax(-1))  # a strided row view


@pytest.mark.parametrize("rows,k,simulated", [(1, 3, False), (5, 3, True), (130, 2, False), (7, 1, True)])
def test_accept_record_equals_greedy_accept_and_record(dev, rows, k, simulated):
    """The fused greedy acceptance: the accepted counts of ``greedy_accept`` (or forced ones, as the simulated
    acceptance of the benchmarks sets them, with the drafts then emitted up to the forced count), the emitted
    tokens, the packed rows the host reads, and the table writes of ``ReqSlots.record`` (padding row, request slot
    0, left alone); more rows than one program's block (130)."""
    from hylo.ops.tables_triton import accept_record
    from hylo.speculative.verify import greedy_accept

    g = torch.Generator().manual_seed(rows * 10 + k)
    t, _ = _tables(dev, max(12, rows), seed=rows)
    best = torch.randint(0, 4, (rows, k + 1), generator=g)
    drafts = torch.where(torch.rand(rows, k, generator=g) < 0.7, best[:, :k], torch.randint(0, 4, (rows, k),
                                                                                           generator=g))
    ids = torch.cat([torch.randint(0, 4, (rows, 1), generator=g), drafts], 1).reshape(-1)
    req = torch.randperm(max(12, rows), generator=g)[:rows] + 1
    if rows > 1:
        req[-1] = 0  # a padding row
    lens = torch.randint(k + 1, 60, (rows,), generator=g)
    forced = torch.randint(0, k + 1, (rows,), generator=g) if simulated else None

    emitted, accepted = greedy_accept(drafts, torch.nn.functional.one_hot(best, 4).float())
    if simulated:
        accepted = forced
        emitted = torch.where(torch.arange(k + 1)[None, :] < forced[:, None],
                              torch.cat([drafts, drafts[:, :1]], 1), best)
    ref = ReqSlots(max(12, rows), 64, dev)
    ref.seq_len.copy_(t.seq_len)
    ref.last_token.copy_(t.last_token)
    real = req != 0
    ref.record(req[real].to(dev), (lens - k + accepted)[real].to(dev), req[real].to(dev),
               emitted[torch.arange(rows), accepted][real].to(dev))

    out_e, out_a, packed = accept_record(best.to(dev), ids.to(dev), req.to(dev), lens.to(dev), t.last_token,
                                         t.seq_len, forced.to(dev) if simulated else None)
    assert torch.equal(out_a.cpu(), accepted) and torch.equal(out_e.cpu(), emitted)
    assert torch.equal(packed.cpu(), torch.cat([emitted, accepted[:, None] + 1], 1))
    assert torch.equal(t.last_token, ref.last_token) and torch.equal(t.seq_len, ref.seq_len)


@pytest.mark.parametrize("seed,big,runs", [(0, False, True), (1, True, True), (2, False, False)])
def test_extend_kernels_equal_the_torch_expansion(dev, seed, big, runs):
    """An EXTEND step's two launches (``tables_triton.extend_tables``) against ``engine.extend.expand_ref``: rows
    found by binary search over the query offsets, runs over the new locations (one reaching past the fed tokens,
    one row with none), a decoding row's token from the device table; ``big``: more tokens and locations than one
    program's block (5700 tokens, 5700 new locations); without ``runs``, no new location at all."""
    from extend_cases import extend_case

    from hylo.engine.extend import ExtendPack, expand_ref
    from hylo.ops.tables_triton import extend_tables

    plan, r2t, last = extend_case(seed, big, runs)
    pack = ExtendPack.build(plan, [], vocab_size=500)
    ref_r2t = r2t.clone()
    ref = expand_ref(pack.views(pack.meta), ref_r2t, last)
    r2t_d = r2t.to(dev)
    t, w, b = (pack.spans[f][1] for f in ("tokens", "locs", "req"))
    got = extend_tables(pack.meta.to(dev), t, w, b, r2t_d, last.to(dev))
    assert torch.equal(r2t_d.cpu(), ref_r2t)
    for name, a, e in zip(("ids", "positions", "locations", "rows", "lengths"), got, ref):
        assert torch.equal(a.cpu(), e), name


@pytest.mark.parametrize("rows,k,simulated", [(3, 3, False), (40, 4, True), (130, 2, False)])
def test_accept_record_stops_at_max_tokens_and_eos(dev, rows, k, simulated):
    """With the request table and the end-of-sequence ids, the fused acceptance takes no draft past a row's
    max_tokens or its first end-of-sequence token (unless the row ignores them): as ``accept_limit`` on top of
    ``greedy_accept`` (or the forced counts)."""
    from hylo.ops.tables_triton import accept_record
    from hylo.speculative.verify import accept_limit, greedy_accept

    g = torch.Generator().manual_seed(rows + 100 * k)
    n = max(12, rows)
    t, _ = _tables(dev, n, seed=rows + 1)
    best = torch.randint(0, 6, (rows, k + 1), generator=g)
    drafts = torch.where(torch.rand(rows, k, generator=g) < 0.8, best[:, :k], torch.randint(0, 6, (rows, k),
                                                                                           generator=g))
    ids = torch.cat([torch.randint(0, 6, (rows, 1), generator=g), drafts], 1).reshape(-1)
    req = torch.randperm(n, generator=g)[:rows] + 1
    prompt = torch.randint(1, 20, (n + 1,), generator=g)
    done = torch.randint(0, 10, (rows,), generator=g)  # output tokens before this step
    lens = done + k + prompt[req]
    ids.view(rows, k + 1)[::5, 0] = 2  # some rows' newest token is an end-of-sequence id: their request had ended
    samp = torch.zeros(n + 1, 5, dtype=torch.int64)
    samp[:, 2] = prompt
    samp[:, 3] = torch.randint(1, 14, (n + 1,), generator=g)  # max_tokens (some already at their end)
    samp[:, 4] = (torch.rand(n + 1, generator=g) < 0.7).long()  # stops at end-of-sequence ids
    eos = torch.tensor([2, 5])
    forced = torch.randint(0, k + 1, (rows,), generator=g) if simulated else None

    emitted, accepted = greedy_accept(drafts, torch.nn.functional.one_hot(best, 6).float())
    if simulated:
        accepted = forced
        emitted = torch.where(torch.arange(k + 1)[None, :] < forced[:, None],
                              torch.cat([drafts, drafts[:, :1]], 1), best)
    accepted = torch.minimum(accepted, accept_limit(emitted, ids.view(rows, k + 1)[:, 0], req, lens, samp, eos))
    before = (t.last_token.clone(), t.seq_len.clone())
    out_e, out_a, packed = accept_record(best.to(dev), ids.to(dev), req.to(dev), lens.to(dev), t.last_token,
                                         t.seq_len, forced.to(dev) if simulated else None, samp.to(dev), eos.to(dev))
    assert torch.equal(out_a.cpu(), accepted) and (accepted == -1).any()
    inert = req[accepted == -1].to(t.seq_len.device)  # their tables as they were
    assert torch.equal(t.last_token[inert], before[0][inert]) and torch.equal(t.seq_len[inert], before[1][inert])
    assert torch.equal(packed.cpu()[:, -1], accepted + 1)
    kept = accepted.clamp(min=0)
    assert torch.equal(out_e.cpu()[torch.arange(rows), kept], emitted[torch.arange(rows), kept])
