"""Fused MoE and norm Triton kernels against their torch references (the routing kernels: test_kernels_route.py)."""

import pytest
import torch

from hylo.ops.moe import fused_moe_ref, route_topk
from hylo.ops.norm import gated_rms_norm, rms_norm


def _moe_case(dev, seed, tokens, experts, top_k, hidden, inter, gated=True):
    """Random MoE inputs on ``dev`` (bfloat16 on CUDA; float32 under the interpreter, which has no bfloat16 dot)
    as ``fused_moe``'s arguments (SwiGLU experts, or with ``gated=False`` squared-ReLU ones), and their float64
    reference output."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, (2 if gated else 1) * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = route_topk(torch.randn(tokens, experts, generator=g), top_k, True)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids, gated)
    return (x.to(dev, dtype), w13.to(dev, dtype), w2.to(dev, dtype), weights.to(dev, dtype), ids.to(dev)), ref


def _assert_close_to(out, ref):
    tol = 3e-2 if out.dtype == torch.bfloat16 else 1e-4
    assert (out.double().cpu() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 2, 48, 40), (3, 64, 10, 64, 32),
                                                                (37, 8, 3, 40, 24), (9, 64, 10, 96, 80),
                                                                (70, 8, 3, 40, 24), (2, 513, 11, 64, 32)])
@pytest.mark.parametrize("summed", [True, False])
def test_fused_moe_matches_reference(dev, tokens, experts, top_k, hidden, inter, summed, monkeypatch):
    from hylo.ops import moe_pairs_triton
    from hylo.ops.moe_triton import fused_moe

    monkeypatch.setattr(moe_pairs_triton, "PAIR_DOWN_SUM", summed)
    args, ref = _moe_case(dev, 3, tokens, experts, top_k, hidden, inter)
    _assert_close_to(fused_moe(*args), ref)


def test_grouped_mm_moe_matches_reference(dev):
    """The prefill MoE through torch._grouped_mm (CUTLASS on the H200, torch's CPU kernels under the interpreter)
    gives the reference's per-token sums: experts with no pairs, uneven groups, the weighted gather-sum."""
    from hylo.ops.moe_grouped_mm import fused_moe_grouped_mm

    g = torch.Generator().manual_seed(5)
    T, H, I, E, k = 37, 32, 24, 9, 3
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, torch.randn(E, H, I, generator=g) / I ** 0.5
    logits = torch.randn(T, E, generator=g)
    logits[:, 4] = -1e4  # expert 4 is never chosen: an empty group
    weights, ids = route_topk(logits, k, True)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    cases = ((torch.bfloat16, 3e-2),) if dev.type == "cuda" else ((torch.float32, 1e-5),)  # CUTLASS: 16-bit
    for dtype, tol in cases:
        out = fused_moe_grouped_mm(x.to(dev, dtype), w13.to(dev, dtype), w2.to(dev, dtype), weights.to(dev, dtype),
                                   ids.to(dev))
        assert out.shape == (T, 1, H) and out.dtype == torch.float32
        assert (out[:, 0].double().cpu() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("tokens,hidden", [(1031, 64), (37, 96)])
def test_residual_add_gathers_the_grouped_mm_rows(dev, tokens, hidden):
    """The prefill MoE's rows left in expert order (``fused_moe_grouped_mm(reduce=False)``) and summed by the
    residual add-norm kernel as it gathers them: the same residual and normed rows as adding the reduced sums, and
    the float64 reference's; 1031 rows take the prefill tiles (several rows a program, the last one partial), 37
    one row a program, 96 a width that is not a power of two."""
    from hylo.ops.pair_rows import SortedPairRows
    from hylo.ops.moe_grouped_mm import fused_moe_grouped_mm
    from hylo.ops.norm import add_rms_norm, rms_norm_ref

    args, ref = _moe_case(dev, 8, tokens, experts=9, top_k=3, hidden=hidden, inter=32)
    x, w13, w2, weights, ids = args
    g = torch.Generator().manual_seed(9)
    resid = torch.randn(tokens, hidden, generator=g).to(dev, x.dtype)
    nw = torch.randn(hidden, generator=g).to(dev)
    pairs = fused_moe_grouped_mm(x, w13, w2, weights, ids, reduce=False)
    assert isinstance(pairs, SortedPairRows) and pairs.num_tokens == tokens
    res, y = add_rms_norm(resid, pairs, nw, 1e-6)
    res_sum, y_sum = add_rms_norm(resid, pairs.reduce(), nw, 1e-6)
    ulp = 2.0 ** -7 if x.dtype == torch.bfloat16 else 1e-6  # the sum's FMA may round one way or the other
    assert torch.allclose(res.float(), res_sum.float(), rtol=ulp, atol=ulp)
    assert torch.allclose(y.float(), y_sum.float(), rtol=2 * ulp, atol=2 * ulp)
    want = resid.double().cpu() + ref
    _assert_close_to(res, want)
    _assert_close_to(y, rms_norm_ref(want.to(x.dtype), nw.cpu(), 1e-6).double())
    with pytest.raises(ValueError, match="pair rows of"):
        add_rms_norm(resid[:-1], pairs, nw, 1e-6)


@pytest.mark.parametrize("tokens", [1, 7, 40, 600])
@pytest.mark.parametrize("grouped_mm", [True, False])
def test_non_gated_experts_match_reference(dev, tokens, grouped_mm, monkeypatch):
    """Nemotron 3's squared-ReLU experts (up rows only, ``gated=False``) through every layout: the pair kernels (1
    and 7 tokens), the Triton grouped kernel (40 tokens; 600 without torch._grouped_mm) and torch._grouped_mm's
    activation pass (600 tokens where the GPU has it); a hidden size and intermediate size that are not powers of
    two. The gated reading of the same weights is refused by their shapes."""
    from hylo.ops import moe_grouped_mm
    from hylo.ops.moe_triton import fused_moe

    if not grouped_mm:
        monkeypatch.setattr(moe_grouped_mm, "GROUPED_MM_MIN_PAIRS", 1 << 40)
    args, ref = _moe_case(dev, 11, tokens, experts=16, top_k=6, hidden=72, inter=40, gated=False)
    out = fused_moe(*args, gated=False)
    assert out.shape == ref.shape
    _assert_close_to(out, ref)
    # float32 routing weights (Nemotron 3's router keeps them so) with bfloat16 activations
    x, w13, w2, weights, ids = args
    _assert_close_to(fused_moe(x, w13, w2, weights.float(), ids, gated=False), ref)
    with pytest.raises(ValueError, match="gated"):
        fused_moe(*args)


@pytest.mark.parametrize("cfg", [(16, 32, 32, 4, 2, 64, 16, 4, 2), (32, 16, 16, 4, 2, 16, 64, 2, 3)])
def test_grouped_moe_with_its_own_down_tiles(dev, cfg, monkeypatch):
    """A grouped-kernel config with a second tile set for the down kernel (as ``HYLO_GROUPED_CFG`` may give):
    output blocks that differ from gate/up's, including a BN past H's end (masked columns)."""
    from hylo.ops import moe_grouped_mm, moe_triton

    monkeypatch.setattr(moe_triton, "PAIR_GEMV_MAX_PAIRS", 0)
    monkeypatch.setattr(moe_triton, "GROUPED_CFG", ((1 << 62, cfg),))
    monkeypatch.setattr(moe_grouped_mm, "GROUPED_MM_MIN_PAIRS", 1 << 40)
    args, ref = _moe_case(dev, 6, tokens=29, experts=12, top_k=3, hidden=40, inter=48)
    _assert_close_to(moe_triton.fused_moe(*args), ref)


@pytest.mark.parametrize("grouped_mm", [True, False])
def test_prefill_sized_moe_matches_reference(dev, grouped_mm, monkeypatch):
    """A prefill chunk's worth of pairs: through torch._grouped_mm where the GPU has it, and through the Triton
    grouped kernel (what older GPUs and float32 use); both against the float64 reference."""
    from hylo.ops import moe_grouped_mm
    from hylo.ops.moe_triton import fused_moe

    if not grouped_mm:
        monkeypatch.setattr(moe_grouped_mm, "GROUPED_MM_MIN_PAIRS", 1 << 40)
    tokens, top_k = 600, 10
    args, ref = _moe_case(dev, 4, tokens, experts=64, top_k=top_k, hidden=256, inter=128)
    if grouped_mm and dev.type == "cuda" and torch.cuda.get_device_capability()[0] in (9, 10):
        assert moe_grouped_mm.grouped_mm_usable(args[0], args[1], args[2], tokens * top_k)
    _assert_close_to(fused_moe(*args), ref)


@pytest.mark.parametrize("tokens,top_k,experts,bm", [(50, 3, 8, 16), (32, 11, 65, 16), (256, 11, 65, 64),
                                                       (7, 2, 5, 16), (1, 1, 3, 32), (64, 11, 513, 16)])
def test_align_pairs_blocks_hold_one_expert_each(dev, tokens, top_k, experts, bm):
    from hylo.ops.moe_triton import align_pairs

    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = 0  # one hot expert spanning several blocks
    sorted_pairs, block_expert = align_pairs(ids.to(dev), experts, bm)
    sp, be = sorted_pairs.cpu(), block_expert.cpu()
    flat = ids.reshape(-1)
    seen, last = [], -1
    for b, e in enumerate(be.tolist()):
        if e < 0:  # unused blocks come after every used one
            last = max(last, 10 ** 9)
            continue
        assert last < 10 ** 9 and e >= last  # runs in expert order, contiguous
        last = e
        pairs = sp[b * bm:(b + 1) * bm]
        real = pairs[pairs < flat.numel()]
        assert (pairs[real.numel():] == flat.numel()).all()  # a block's pairs first, then the sentinel
        assert (flat[real] == e).all()
        assert real.tolist() == sorted(real.tolist())  # pair order kept within an expert
        seen.extend(real.tolist())
    assert sorted(seen) == list(range(flat.numel()))
    counts = torch.bincount(flat, minlength=experts)
    assert (be >= 0).sum().item() == int(((counts + bm - 1) // bm).sum())


@pytest.mark.parametrize("rows,dim", [(5, 48), (130, 2048), (3, 20), (1500, 48), (1030, 300)])
def test_norm_kernels_match_reference(dev, rows, dim):
    from hylo.ops.norm_triton import add_rms_norm, gated_rms_norm_triton, rms_norm_triton

    g = torch.Generator().manual_seed(5)
    x, r, z = (torch.randn(rows, dim, generator=g) for _ in range(3))
    wv = torch.randn(dim, generator=g)
    assert torch.allclose(rms_norm_triton(x.to(dev), wv.to(dev), 1e-6).cpu(), rms_norm(x, wv, 1e-6), atol=1e-5)
    ref_res = x + r
    res, y = add_rms_norm(x.to(dev), r.to(dev), wv.to(dev), 1e-6)
    assert torch.allclose(res.cpu(), ref_res, atol=1e-6)
    assert torch.allclose(y.cpu(), rms_norm(ref_res, wv, 1e-6), atol=1e-5)
    assert torch.allclose(gated_rms_norm_triton(x.to(dev), z.to(dev), wv.to(dev), 1e-6).cpu(),
                          gated_rms_norm(x, z, wv, 1e-6), atol=1e-5)
    # unreduced deltas: J rows per row, summed with the residual
    d = torch.randn(rows, 3, dim, generator=g)
    res, y = add_rms_norm(x.to(dev), d.to(dev), wv.to(dev), 1e-6)
    assert torch.allclose(res.cpu(), x + d.sum(1), atol=1e-5)
    assert torch.allclose(y.cpu(), rms_norm(x + d.sum(1), wv, 1e-6), atol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,dim,rot", [(4, 2, 24, 6), (16, 2, 256, 64), (6, 3, 20, 10)])
def test_qk_norm_rope_matches_reference(dev, heads, kv_heads, dim, rot):
    from hylo.layers.rotary import RotaryEmbedding
    from hylo.ops.norm_triton import qk_norm_rope

    g = torch.Generator().manual_seed(7)
    tokens = 5
    width = 2 * heads * dim + 2 * kv_heads * dim
    proj = torch.randn(tokens, width, generator=g)
    qw, kw = torch.randn(dim, generator=g) * 0.1, torch.randn(dim, generator=g) * 0.1
    pos = torch.tensor([0, 3, 17, 1000, 5])
    q_ref = rms_norm(proj[:, :heads * dim].reshape(tokens, heads, dim), qw, 1e-6)
    k_off = 2 * heads * dim
    k_ref = rms_norm(proj[:, k_off:k_off + kv_heads * dim].reshape(tokens, kv_heads, dim), kw, 1e-6)
    rope = RotaryEmbedding(rot, 10000.0)
    q_ref, k_ref = rope(pos, q_ref, k_ref)
    q, k = qk_norm_rope(proj.to(dev), pos.to(dev), qw.to(dev), kw.to(dev), heads, kv_heads, dim, rot,
                        rope.inv_freq.to(dev), 1e-6, k_off)
    assert torch.allclose(q.cpu(), q_ref, atol=1e-4) and torch.allclose(k.cpu(), k_ref, atol=1e-4)
    # the keys and values straight into a pool (at locations out of order, the dummy 0 among them) instead
    kc = torch.full((40, kv_heads, dim), 7.0, device=dev)
    vc = torch.full((40, kv_heads, dim), 7.0, device=dev)
    loc = torch.tensor([9, 0, 31, 2, 17], device=dev)
    q2, k2 = qk_norm_rope(proj.to(dev), pos.to(dev), qw.to(dev), kw.to(dev), heads, kv_heads, dim, rot,
                          rope.inv_freq.to(dev), 1e-6, k_off, kv_store=(kc, vc, loc))
    assert k2 is None and torch.equal(q2.cpu(), q.cpu())
    kc_ref = torch.full((40, kv_heads, dim), 7.0)
    vc_ref = torch.full((40, kv_heads, dim), 7.0)
    kc_ref[loc.cpu()] = k.cpu()
    vc_ref[loc.cpu()] = proj[:, k_off + kv_heads * dim:].reshape(tokens, kv_heads, dim)
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)
    # keys only (no query heads): the MTP head's plain-step store from its key/value projection rows alone
    kv_only = proj[:, k_off:].contiguous()
    kc.fill_(7.0)
    vc.fill_(7.0)
    q3, k3 = qk_norm_rope(kv_only.to(dev), pos.to(dev), qw.to(dev), kw.to(dev), 0, kv_heads, dim, rot,
                          rope.inv_freq.to(dev), 1e-6, 0, kv_store=(kc, vc, loc))
    assert k3 is None and q3.numel() == 0
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)


@pytest.mark.parametrize("tokens", [3, 301])  # 12 rows: one per program; 1204 rows: packed tiles (prefill)
def test_gated_norm_reads_a_strided_gate(dev, tokens):
    from hylo.ops.norm_triton import gated_rms_norm_triton

    g = torch.Generator().manual_seed(8)
    proj = torch.randn(tokens, 100, generator=g)
    x = torch.randn(tokens, 4, 20, generator=g)
    gate = proj[:, 10:90].reshape(tokens, 4, 20)  # a view with row stride 100
    w = torch.randn(20, generator=g)
    out = gated_rms_norm_triton(x.to(dev), proj.to(dev)[:, 10:90].reshape(tokens, 4, 20), w.to(dev), 1e-6)
    assert torch.allclose(out.cpu(), gated_rms_norm(x, gate, w, 1e-6), atol=1e-5)


def test_grouped_cfg_setting_parses_and_names_bad_entries():
    from hylo.ops.moe_triton import parse_grouped_cfg

    table = parse_grouped_cfg("1024:16,64,128,4,3; max:64,64,64,4,3,128,64,8,3")
    assert table == ((1024, (16, 64, 128, 4, 3)), (1 << 62, (64, 64, 64, 4, 3, 128, 64, 8, 3)))
    for bad in ("max:64,64,64", "max:64,64,x,4,3", "1O24:16,64,128,4,3;max:64,64,64,4,3", "max:64,0,64,4,3"):
        with pytest.raises(ValueError, match="HYLO_GROUPED_CFG entry.*5 or 9 positive integers"):
            parse_grouped_cfg(bad)
    with pytest.raises(ValueError, match="limits must increase"):
        parse_grouped_cfg("1024:16,64,128,4,3;512:16,64,128,4,3;max:64,64,64,4,3")
    with pytest.raises(ValueError, match="'max'"):
        parse_grouped_cfg("1024:16,64,128,4,3")


@pytest.mark.parametrize("tokens,experts,top_k", [(1000, 65, 11), (12000, 65, 11), (37, 9, 3), (1, 5, 2),
                                                  (300, 513, 11), (700, 255, 4)])
def test_prefill_counting_sort_of_pairs_equals_a_stable_argsort(dev, tokens, experts, top_k):
    """The prefill MoE's sort of (token, expert) pairs by expert: the order of a stable argsort, its inverse, and
    the group ends, with experts that get no pair and pair counts that are not multiples of the chunk (513
    experts: the torch sort that takes over for many experts; 255, the most the counting sort takes; 12000 tokens:
    1032 chunks, two blocks of each expert's scan)."""
    from hylo.ops.moe_grouped_mm import sort_pairs_by_expert

    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts - 1, (tokens * top_k,), generator=g)  # the last expert gets no pair
    pos, tok, ends = sort_pairs_by_expert(ids.to(dev), experts, top_k)
    order = ids.argsort(stable=True)
    assert torch.equal(tok.cpu(), order // top_k)
    assert torch.equal(pos.cpu()[order], torch.arange(ids.numel()))
    assert torch.equal(ends.cpu(), torch.bincount(ids, minlength=experts).cumsum(0).int())


@pytest.mark.parametrize("tokens,hidden,pairs", [(37, 100, 301), (5, 2048, 17), (9, 3000, 4)])
def test_gather_rows_matches_index_select(dev, tokens, hidden, pairs):
    """The prefill MoE's pair-row gather (``HYLO_GATHER_ROWS``) against ``index_select``: rows repeated and
    skipped, widths that are not a power of two or wider than one column block, row counts not a multiple of the
    row block."""
    from hylo.ops.moe_grouped_mm import gather_rows

    g = torch.Generator().manual_seed(pairs)
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    tok = torch.randint(0, tokens, (pairs,), generator=g).to(dev)
    assert torch.equal(gather_rows(x, tok, triton_kernel=True), x.index_select(0, tok))


@pytest.mark.parametrize("tokens,hidden,top_k,experts", [(37, 100, 3, 8), (5, 2048, 4, 16), (9, 3000, 2, 5),
                                                          (130, 64, 11, 65)])
def test_scatter_rows_equal_the_gather_of_the_sorted_pairs(dev, tokens, hidden, top_k, experts):
    """The prefill MoE's pair rows written by pair (``scatter_rows``, the default) against ``index_select`` by the
    sort's ``tok``, for every mode of ``sorted_rows``: token counts not a multiple of the token block, widths not a
    power of two or wider than one column block, experts some tokens share and some no token picks."""
    from hylo.ops.moe_grouped_mm import sort_pairs_by_expert, sorted_rows

    g = torch.Generator().manual_seed(tokens * top_k)
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(dev)
    pos, tok, _ = sort_pairs_by_expert(ids.reshape(-1).contiguous(), experts, top_k)
    want = x.index_select(0, tok)
    assert torch.equal(want[pos], x.repeat_interleave(top_k, 0))  # the sort's pos and tok agree
    for mode in ("scatter", "gather", "torch"):
        assert torch.equal(sorted_rows(x, pos, tok, top_k, mode), want), mode
    with pytest.raises(ValueError, match="mode 'index'"):
        sorted_rows(x, pos, tok, top_k, "index")
