"""Paged attention Triton kernel against the torch reference: decode and verify shapes, GQA, odd head sizes."""

import pytest
import torch

from hylo.ops.attention import decode_attention_ref


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 24), (16, 2, 256), (6, 3, 20), (4, 2, 6)])
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_reference(dev, heads, kv_heads, dim, steps, dtype):
    from hylo.ops.attention_triton import paged_attention

    if dtype == torch.bfloat16 and dev.type != "cuda":
        pytest.skip("bfloat16 kernels are checked on the GPU")
    g = torch.Generator().manual_seed(2)
    batch, n_loc, width = 3, 700, 400
    kc = torch.randn(n_loc, kv_heads, dim, generator=g)
    vc = torch.randn(n_loc, kv_heads, dim, generator=g)
    r2t = torch.zeros(5, width, dtype=torch.int64)
    for r in range(5):
        r2t[r] = torch.randperm(n_loc - 1, generator=g)[:width] + 1
    seq_lens = torch.tensor([steps, 333, 57 + steps])  # includes a row whose only keys are its own queries
    req_slots = torch.tensor([4, 1, 2])
    q = torch.randn(batch * steps, heads, dim, generator=g)
    ref = decode_attention_ref(q, kc, vc, r2t, req_slots, seq_lens, int(seq_lens.max()), dim ** -0.5, steps)
    if dtype == torch.bfloat16:
        q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
        ref = decode_attention_ref(q.float(), kc.float(), vc.float(), r2t, req_slots, seq_lens, int(seq_lens.max()),
                                   dim ** -0.5, steps)
    out = paged_attention(q.to(dev), kc.to(dev), vc.to(dev), r2t.to(dev), req_slots.to(dev), seq_lens.to(dev),
                          dim ** -0.5, steps)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.cpu().float(), ref, atol=tol, rtol=tol)
    # the output gate inside the merge, read in place from a wider projection row (a strided view)
    proj = torch.randn(batch * steps, 2 * heads * dim + 8, generator=g).to(q.dtype)
    gate = proj[:, heads * dim:2 * heads * dim]
    gated = paged_attention(q.to(dev), kc.to(dev), vc.to(dev), r2t.to(dev), req_slots.to(dev), seq_lens.to(dev),
                            dim ** -0.5, steps, gate=gate.to(dev))
    want = out.cpu().reshape(batch * steps, -1) * torch.sigmoid(gate)  # torch's rounding of the unfused expression
    assert torch.allclose(gated.cpu().reshape(batch * steps, -1).float(), want.float(), atol=1e-6 if dtype ==
                          torch.float32 else 1e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("dim", [32, 256])
def test_one_long_row_uses_many_splits(dev, steps, dim):
    """Batch 1: the keys are split 128 ways (some shares empty) and the merge reads only the used ones, in several
    chunks (and, with 256 channels, in several channel blocks)."""
    from hylo.ops.attention_triton import MAX_SPLITS, num_splits, paged_attention

    assert num_splits(1, 2, torch.device("cuda") if dev.type == "cuda" else dev) == MAX_SPLITS
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, n_loc, seq = 4, 2, 3000, 2500
    kc, vc = torch.randn(n_loc, kv_heads, dim, generator=g), torch.randn(n_loc, kv_heads, dim, generator=g)
    r2t = (torch.randperm(n_loc - 1, generator=g)[:seq] + 1)[None]
    seq_lens, req_slots = torch.tensor([seq]), torch.tensor([0])
    q = torch.randn(steps, heads, dim, generator=g)
    ref = decode_attention_ref(q, kc, vc, r2t, req_slots, seq_lens, seq, dim ** -0.5, steps)
    out = paged_attention(q.to(dev), kc.to(dev), vc.to(dev), r2t.to(dev), req_slots.to(dev), seq_lens.to(dev),
                          dim ** -0.5, steps)
    assert torch.allclose(out.cpu(), ref, atol=2e-3, rtol=2e-3)


def test_store_kv_writes_both_caches_from_strided_values(dev):
    """Keys and values in one launch: v read in place from a wider projection; other locations untouched."""
    from hylo.ops.attention import store_kv

    g = torch.Generator().manual_seed(4)
    tokens, kv_heads, dim, n_loc = 5, 2, 24, 40
    kc, vc = torch.randn(n_loc, kv_heads, dim, generator=g), torch.randn(n_loc, kv_heads, dim, generator=g)
    proj = torch.randn(tokens, 7 + kv_heads * dim, generator=g)
    k, v = torch.randn(tokens, kv_heads, dim, generator=g), proj[:, 7:].reshape(tokens, kv_heads, dim)
    loc = torch.tensor([3, 0, 17, 39, 8])
    want_k, want_v = kc.clone(), vc.clone()
    want_k[loc], want_v[loc] = k, v
    kd, vd = kc.to(dev), vc.to(dev)
    store_kv(kd, vd, loc.to(dev), k.to(dev), proj.to(dev)[:, 7:].reshape(tokens, kv_heads, dim))
    assert torch.equal(kd.cpu(), want_k) and torch.equal(vd.cpu(), want_v)


def test_prefill_attention_reads_shared_kv_heads_in_place(dev):
    """The prefill path (torch's fused attention, K/V heads not repeated where a fused kernel takes them) against
    the float32 reference: bench-6b's head shape, a row with a cached prefix (masked) and one without (causal)."""
    from hylo.ops import attention as ops

    if dev.type != "cuda":
        pytest.skip("torch's fused attention kernels need CUDA")
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, n_loc = 16, 2, 256, 1200
    kc = torch.randn(n_loc, kv_heads, dim, generator=g).bfloat16()
    vc = torch.randn(n_loc, kv_heads, dim, generator=g).bfloat16()
    r2t = torch.zeros(3, 600, dtype=torch.int64)
    perm = torch.randperm(n_loc - 1, generator=g) + 1
    r2t[1, :500], r2t[2, :300] = perm[:500], perm[500:800]
    q = torch.randn(200 + 300, heads, dim, generator=g).bfloat16()
    args = ([1, 2], [300, 0], [200, 300], dim ** -0.5)
    ref = ops.extend_attention_ref(q.float(), kc.float(), vc.float(), r2t, *args)
    out = ops.extend_attention_sdpa(q.to(dev), kc.to(dev), vc.to(dev), r2t.to(dev), *args)
    assert torch.allclose(out.cpu().float(), ref, atol=3e-2, rtol=3e-2)
    # the causal call (a prefill without a cached prefix) found a fused kernel that takes the shared heads as they
    # are, not repeated (the masked one may not: it then repeats them, as before)
    assert ops._GQA_FUSED[(str(out.device), torch.bfloat16, heads, kv_heads, dim, False)]


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 24), (16, 2, 256), (6, 6, 64), (4, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_attention_kernel_matches_reference(dev, heads, kv_heads, dim, dtype):
    """Prefill chunks with and without a cached prefix, decoding rows (one query on a long prefix), a row longer
    than one query block, an empty row: one launch against the row-by-row float32 reference."""
    from hylo.ops import attention as ops
    from hylo.ops.attention_extend_triton import block_tokens, extend_attention_triton, query_blocks

    if dtype == torch.bfloat16 and dev.type != "cuda":
        pytest.skip("bfloat16 kernels are checked on the GPU")
    g = torch.Generator().manual_seed(11)
    n_loc, width = 900, 400
    kc = torch.randn(n_loc, kv_heads, dim, generator=g)
    vc = torch.randn(n_loc, kv_heads, dim, generator=g)
    r2t = torch.zeros(6, width, dtype=torch.int64)
    for r in range(6):
        r2t[r] = torch.randperm(n_loc - 1, generator=g)[:width] + 1
    slots = [3, 1, 5, 2, 4]
    prefixes = [0, 137, 300, 0, 61]
    lens = [block_tokens(dim) + 9, 1, 40, 0, 1]  # a row over one block, a decoding row, a chunk on a prefix, ...
    q = torch.randn(sum(lens), heads, dim, generator=g)
    if dtype == torch.bfloat16:
        q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    ref = ops.extend_attention_ref(q.float(), kc.float(), vc.float(), r2t, slots, prefixes, lens, dim ** -0.5)
    qsl = torch.tensor([0] + lens).cumsum(0)
    seq_lens = torch.tensor([p + n for p, n in zip(prefixes, lens)])
    rows = [1, 0, 2, 4]  # any order, any subset: each block names its row
    blocks = query_blocks(rows, lens, block_tokens(dim))
    bt = block_tokens(dim)
    assert blocks.shape[0] == sum(-(-lens[r] // bt) for r in rows) == 2 + -(-40 // bt) + 2
    out = torch.full_like(q, float("nan")).to(dev)
    extend_attention_triton(q.to(dev), kc.to(dev), vc.to(dev), r2t.to(dev), torch.tensor(slots).to(dev),
                            seq_lens.to(dev), qsl.to(dev), blocks.to(dev), out, dim ** -0.5)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.cpu().float(), ref, atol=tol, rtol=tol)
    # a subset writes only its rows
    part = torch.full_like(q, float("nan")).to(dev)
    extend_attention_triton(q.to(dev), kc.to(dev), vc.to(dev), r2t.to(dev), torch.tensor(slots).to(dev),
                            seq_lens.to(dev), qsl.to(dev), query_blocks([2], lens, block_tokens(dim)).to(dev), part,
                            dim ** -0.5)
    first = sum(lens[:2])
    assert torch.isnan(part[:first].cpu()).all() and torch.isnan(part[first + lens[2]:].cpu()).all()
    assert torch.allclose(part[first:first + lens[2]].cpu().float(), ref[first:first + lens[2]], atol=tol, rtol=tol)
