"""GDN and conv Triton kernels against their torch references: random inputs, slot -1 rows, odd sizes."""

import pytest
import torch

from hylo.ops import conv1d as conv_ref
from hylo.ops import gdn as gdn_ref


@pytest.mark.parametrize("hk,hv,dk,dv,batch", [(2, 4, 16, 20, 3), (1, 3, 12, 10, 5), (16, 32, 128, 128, 2)])
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("early", [False, True])
def test_gdn_steps_matches_reference(dev, hk, hv, dk, dv, batch, steps, early, monkeypatch):
    from hylo.ops import gdn_triton
    from hylo.ops.gdn_triton import gdn_steps

    monkeypatch.setattr(gdn_triton, "EARLY_LOADS", early)  # the state loaded before the PDL wait

    g = torch.Generator().manual_seed(0)
    conv_dim = 2 * hk * dk + hv * dv
    x = torch.randn(batch * steps, conv_dim, generator=g)
    a, b = torch.randn(batch * steps, hv, generator=g), torch.randn(batch * steps, hv, generator=g)
    A_log, dt_bias = torch.randn(hv, generator=g) * 0.5, torch.randn(hv, generator=g)
    pool = torch.randn(batch + 2, hv, dk, dv, generator=g) * 0.3
    slots = torch.tensor([batch + 1 - i if i != 1 else -1 for i in range(batch)])
    ref_pool = pool.clone()
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], -1)
    q, k, v = q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), v.reshape(-1, hv, dv)
    gg, beta = gdn_ref.gdn_gating(A_log, a, dt_bias, b)
    valid = (slots >= 0)
    init = ref_pool[slots.clamp(min=0)] * valid[:, None, None, None]
    ro, rstates = gdn_ref.gdn_verify_ref(q.view(batch, steps, hk, dk), k.view(batch, steps, hk, dk),
                                         v.view(batch, steps, hv, dv), gg.view(batch, steps, hv),
                                         beta.view(batch, steps, hv), init)
    t = lambda z: z.to(dev)  # noqa: E731
    if steps == 1:
        dpool = t(pool)
        out = gdn_steps(t(x), t(a), t(b), t(A_log), t(dt_bias), dpool, t(slots), hk, dk, dv)
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                assert torch.allclose(dpool[s].cpu(), rstates[i, 0], atol=1e-4)
        untouched = [j for j in range(batch + 2) if j not in slots.tolist()]
        assert torch.equal(dpool[untouched].cpu(), pool[untouched])
    else:
        verify = torch.full((batch + 1, steps, hv, dk, dv), float("nan"), device=dev)
        dpool = t(pool)
        out = gdn_steps(t(x), t(a), t(b), t(A_log), t(dt_bias), dpool, t(slots), hk, dk, dv, steps, verify)
        assert torch.equal(dpool.cpu(), pool)  # verify never writes the slots
        assert torch.allclose(verify[:batch].cpu(), rstates, atol=1e-4)
    assert torch.allclose(out.cpu().view(batch, steps, hv, dv), ro, atol=1e-4)


@pytest.mark.parametrize("hk,hv,dk,dv,batch", [(2, 4, 16, 20, 3), (1, 3, 12, 10, 5), (16, 32, 128, 128, 2)])
def test_verify_keeping_inputs_then_replay_commit_matches_reference(dev, hk, hv, dk, dv, batch):
    """A verify that keeps its inputs (outputs as the reference's, slots untouched, raw a and b kept), then one
    replay commit over all layers: each row's slot ends at the reference state after its accepted steps; rows with
    slot -1 and slots of no row are untouched."""
    from hylo.ops.gdn_triton import gdn_steps, replay_commit

    g = torch.Generator().manual_seed(3)
    layers, steps = 3, 4
    conv_dim = 2 * hk * dk + hv * dv
    n = batch * steps
    x = torch.randn(layers, n, conv_dim, generator=g)
    a, b = torch.randn(layers, n, hv, generator=g), torch.randn(layers, n, hv, generator=g)
    A_log, dt_bias = torch.randn(layers, hv, generator=g) * 0.5, torch.randn(layers, hv, generator=g)
    pool = torch.randn(layers, batch + 2, hv, dk, dv, generator=g) * 0.3
    slots = torch.tensor([batch + 1 - i if i != 1 else -1 for i in range(batch)])
    accepted = torch.tensor([(i * 3) % steps for i in range(batch)])  # 0 .. k, the first row none accepted
    t = lambda z: z.to(dev)  # noqa: E731
    dpool = t(pool)
    kept_x = torch.full((layers, n + steps, conv_dim), float("nan"), device=dev)  # room for one more row
    kept_ab = torch.full((layers, n + steps, 2, hv), float("nan"), device=dev)
    valid = slots >= 0
    for layer in range(layers):
        q, k, v = x[layer].split([hk * dk, hk * dk, hv * dv], -1)
        gg, beta = gdn_ref.gdn_gating(A_log[layer], a[layer], dt_bias[layer], b[layer])
        init = pool[layer, slots.clamp(min=0)] * valid[:, None, None, None]
        ro, rstates = gdn_ref.gdn_verify_ref(q.reshape(batch, steps, hk, dk), k.reshape(batch, steps, hk, dk),
                                             v.reshape(batch, steps, hv, dv), gg.view(batch, steps, hv),
                                             beta.view(batch, steps, hv), init)
        kept_x[layer, :n] = t(x[layer])  # the conv writes its output there itself
        out = gdn_steps(kept_x[layer, :n], t(a[layer]), t(b[layer]), t(A_log[layer]), t(dt_bias[layer]),
                        dpool[layer], t(slots), hk, dk, dv, steps, keep_ab=kept_ab[layer])
        assert torch.allclose(out.cpu().view(batch, steps, hv, dv), ro, atol=1e-4)
        assert torch.equal(kept_ab[layer, :n, 0].cpu(), a[layer]) and torch.equal(kept_ab[layer, :n, 1].cpu(), b[layer])
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                pool[layer, s] = rstates[i, accepted[i]]  # the reference commit
    assert torch.isnan(kept_ab[:, n:]).all()  # nothing past the batch's tokens
    replay_commit(kept_x, kept_ab, t(A_log), t(dt_bias), dpool, t(slots), t(accepted), hk, dk, dv, steps)
    assert torch.allclose(dpool.cpu(), pool, atol=1e-4)


@pytest.mark.parametrize("channels,kernel,batch", [(7, 4, 3), (300, 4, 2), (33, 3, 4), (5, 2, 2)])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_steps_matches_reference(dev, channels, kernel, batch, steps, dtype, early, bias, monkeypatch):
    """With a bias too (Mamba2's conv)."""
    from hylo.ops import conv1d_triton
    from hylo.ops.conv1d_triton import conv_steps

    monkeypatch.setattr(conv1d_triton, "EARLY_LOADS", early)  # the window and weights loaded before the PDL wait

    if dtype == torch.bfloat16 and dev.type != "cuda":
        pytest.skip("bfloat16 kernels are checked on the GPU")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch * steps, channels, generator=g).to(dtype)
    w = torch.randn(channels, kernel, generator=g).to(dtype)
    pool = torch.randn(batch + 2, channels, kernel - 1, generator=g).to(dtype)
    slots = torch.tensor([batch + 1 - i if i != 0 else -1 for i in range(batch)])
    valid = slots >= 0
    init = pool[slots.clamp(min=0)] * valid[:, None, None]
    b = torch.randn(channels, generator=g).to(dtype) if bias else None
    ro, rstates = conv_ref.causal_conv1d_windows_ref(x.view(batch, steps, channels), init, w, b)
    kw = {"bias": b.to(dev)} if bias else {}
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    dpool = pool.clone().to(dev)
    if steps == 1:
        out = conv_steps(x.to(dev), w.to(dev), dpool, slots.to(dev), **kw)
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                assert torch.allclose(dpool[s].cpu().float(), rstates[i, 0], atol=tol)
        untouched = [j for j in range(batch + 2) if j not in slots.tolist()]
        assert torch.equal(dpool[untouched].cpu(), pool[untouched])
    else:
        verify = torch.full((batch, steps, channels, kernel - 1), float("nan"), device=dev, dtype=dtype)
        out = conv_steps(x.to(dev), w.to(dev), dpool, slots.to(dev), steps, verify, **kw)
        assert torch.equal(dpool.cpu(), pool)
        assert torch.allclose(verify.cpu().float(), rstates, atol=tol)
    assert torch.allclose(out.cpu().float().view(batch, steps, channels), ro.float(), atol=tol * 10, rtol=tol * 10)


def test_commit_copies_the_accepted_checkpoint(dev):
    from hylo.backends.gdn import commit_checkpoints
    from hylo.cache.state_pool import StatePool

    pool = StatePool(3, 6, 10, 4, 2, 4, 5, torch.float32, torch.float32, torch.device("cpu"))
    pool.alloc_verify_buffers(4, 3)
    for t in (pool.conv, pool.recurrent, pool.verify_conv, pool.verify_recurrent):
        t.copy_(torch.randn(t.shape))
    slots, accepted = torch.tensor([5, -1, 2, 3]), torch.tensor([2, 1, 0, 1])
    ref = StatePool(3, 6, 10, 4, 2, 4, 5, torch.float32, torch.float32, torch.device("cpu"))
    ref.alloc_verify_buffers(4, 3)
    for a, b in zip((ref.conv, ref.recurrent, ref.verify_conv, ref.verify_recurrent),
                    (pool.conv, pool.recurrent, pool.verify_conv, pool.verify_recurrent)):
        a.copy_(b)
    commit_checkpoints(ref, slots, accepted)  # torch path (CPU tensors)
    for name in ("conv", "recurrent", "verify_conv", "verify_recurrent"):
        setattr(pool, name, getattr(pool, name).to(dev))
    commit_checkpoints(pool, slots.to(dev), accepted.to(dev))  # Triton path
    assert torch.equal(pool.conv.cpu(), ref.conv) and torch.equal(pool.recurrent.cpu(), ref.recurrent)
    assert torch.equal(ref.recurrent[:, 5], ref.verify_recurrent[:, 0, 2])


def _l2_heads(t: torch.Tensor, d: int) -> torch.Tensor:
    heads = t.view(t.shape[0], -1, d)
    return (heads / (heads.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()).view(t.shape)


@pytest.mark.parametrize("lens,kernel", [([5, 1, 9], 4), ([2, 3], 4), ([1, 1, 1, 7], 3), ([40], 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_matches_reference(dev, lens, kernel, dtype):
    from hylo.ops.conv1d_triton import conv_prefill

    if dtype == torch.bfloat16 and dev.type != "cuda":
        pytest.skip("bfloat16 kernels are checked on the GPU")
    g = torch.Generator().manual_seed(9)
    channels = 300
    x = torch.randn(sum(lens), channels, generator=g).to(dtype)
    w = torch.randn(channels, kernel, generator=g).to(dtype)
    pool = torch.randn(len(lens) + 2, channels, kernel - 1, generator=g).to(dtype)
    slots = torch.tensor([len(lens) + 1 - i if i != 1 else -1 for i in range(len(lens))])
    qsl = torch.tensor([0] + lens).cumsum(0)
    dpool = pool.clone().to(dev)
    out = conv_prefill(x.to(dev), w.to(dev), dpool, slots.to(dev), qsl.to(dev), lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, (s, n) in enumerate(zip(slots.tolist(), lens)):
        xs = x[qsl[b]:qsl[b] + n]
        ro, rs = conv_ref.causal_conv1d_ref(xs, pool[s] if s >= 0 else None, w)
        assert torch.allclose(out[qsl[b]:qsl[b] + n].cpu().float(), ro.float(), atol=tol * 10, rtol=tol * 10)
        if s >= 0:
            assert torch.allclose(dpool[s].cpu().float(), rs, atol=tol)
    untouched = [j for j in range(len(lens) + 2) if j not in slots.tolist()]
    assert torch.equal(dpool[untouched].cpu(), pool[untouched])
    # the same output as three contiguous planes (GDN q | k | v for fla), split at channels that cut blocks
    planes = conv_prefill(x.to(dev), w.to(dev), pool.clone().to(dev), slots.to(dev), qsl.to(dev), lens,
                          planes=(70, 110))
    assert all(p.is_contiguous() for p in planes) and [p.shape[1] for p in planes] == [70, 110, 120]
    assert torch.equal(torch.cat(planes, dim=1), out)
    # small token blocks: blocks that straddle rows and end past the last token
    small = conv_prefill(x.to(dev), w.to(dev), pool.clone().to(dev), slots.to(dev), qsl.to(dev), lens,
                         cfg=(4, 64, 2))
    assert torch.equal(small, out)
    # planes at block boundaries and 296 channels (stores a block at a time); the last block runs past them
    aligned = conv_prefill(x[:, :296].to(dev), w[:296].to(dev), pool.clone().to(dev)[:, :296], slots.to(dev),
                           qsl.to(dev), lens, planes=(64, 128), cfg=(8, 64, 2))
    assert [p.shape[1] for p in aligned] == [64, 128, 104]
    assert torch.equal(torch.cat(aligned, dim=1), out[:, :296])
    # the walking kernel (width 4, blocks inside a plane): blocks of 3 and 16 tokens, rows starting mid-block
    if kernel == 4:
        for bt in (3, 16):
            walked = conv_prefill(x[:, :296].to(dev), w[:296].to(dev), pool.clone().to(dev)[:, :296], slots.to(dev),
                                  qsl.to(dev), lens, planes=(64, 128), cfg=(bt, 64, 2, 1))
            assert torch.allclose(torch.cat(walked, dim=1).float(), out[:, :296].float(), atol=tol, rtol=tol)
        # q and k L2-normalised per 32-channel head on the way (the fla prefill's inputs); v as it was
        *normed, done = conv_prefill(x[:, :296].to(dev), w[:296].to(dev), pool.clone().to(dev)[:, :296],
                                     slots.to(dev), qsl.to(dev), lens, planes=(64, 128), cfg=(16, 64, 2, 1),
                                     l2norm_head=32)
        assert done
        ref_q, ref_k, ref_v = (p.float() for p in aligned)
        for got, want in zip(normed, (_l2_heads(ref_q, 32), _l2_heads(ref_k, 32), ref_v)):
            assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
        # a walk tile wider than the planes narrows to fit them (512 -> 64 channels here) and still normalises
        *narrowed, done = conv_prefill(x[:, :296].to(dev), w[:296].to(dev), pool.clone().to(dev)[:, :296],
                                       slots.to(dev), qsl.to(dev), lens, planes=(64, 128), cfg=(16, 512, 2, 1),
                                       l2norm_head=32)
        assert done and all(torch.equal(a, b) for a, b in zip(narrowed, normed))
        # the 2D kernel does not normalise: it says so
        assert not conv_prefill(x[:, :296].to(dev), w[:296].to(dev), pool.clone().to(dev)[:, :296], slots.to(dev),
                                qsl.to(dev), lens, planes=(64, 128), cfg=(8, 64, 2), l2norm_head=32)[3]


@pytest.mark.parametrize("lens", [[130, 1, 64], [8192], [63, 64, 65, 200]])
def test_prefill_chunk_index_equals_fla(lens):
    """The chunk index handed to fla (built on the host with the other prefill indices, copied without a sync) is
    the one fla would build itself."""
    index = pytest.importorskip("fla.ops.utils.index")
    from hylo.backends.gdn import FLA_CHUNK, PrefillIndex

    ix = PrefillIndex.build([0] * len(lens), lens, "cpu")
    assert torch.equal(index.prepare_chunk_indices(ix.cu_seqlens, FLA_CHUNK), ix.chunk_indices)


def test_conv_prefill_setting_names_a_bad_value():
    from hylo.ops.conv1d_triton import _parse_conv_cfg

    assert _parse_conv_cfg("8,128,4") == (8, 128, 4)
    assert _parse_conv_cfg("32,256,4,1") == (32, 256, 4, 1)
    for bad in ("8,128", "a,b,c", "8,0,4", "8,128,4,2", "8,128,4,1,1"):
        with pytest.raises(ValueError, match="HYLO_CONV_PREFILL_CFG"):
            _parse_conv_cfg(bad)


def test_fla_prefill_direct_call_equals_fla_public_api(dev):
    """The prefill's fla call under the public entry point (gate computed in fla's kernel, q and k normalised by
    the caller or by fla) against fla's public function on the torch-computed gate: two rows, one from a state."""
    if dev.type != "cuda":
        pytest.skip("fla's kernels need CUDA")
    from hylo.ops import gdn_fla
    from hylo.ops.gdn import gdn_gating, l2norm

    fla = gdn_fla.load()
    if fla is None or not fla.direct:
        pytest.skip("fla-core with its 0.6 forward is not installed")
    g = torch.Generator().manual_seed(11)
    lens, hk, hv, d = [100, 157], 2, 4, 64
    t = sum(lens)
    q, k = torch.randn(t, hk, d, generator=g), torch.randn(t, hk, d, generator=g)
    v = torch.randn(t, hv, d, generator=g)
    a, b = torch.randn(t, hv, generator=g), torch.randn(t, hv, generator=g)
    A_log, dt_bias = torch.rand(hv, generator=g), torch.randn(hv, generator=g)
    init = torch.randn(2, hv, d, d, generator=g) * 0.1
    init[1] = 0
    cu = torch.tensor([0, lens[0], t])
    from hylo.backends.gdn import FLA_CHUNK, PrefillIndex

    ix = PrefillIndex.build([3, -1], lens, dev)
    cuda = lambda *ts: [x.to(dev, torch.bfloat16) for x in ts]  # noqa: E731
    qc, kc, vc, ac, bc = cuda(q, k, v, a, b)
    A_c, dt_c, init_c = A_log.to(dev), dt_bias.to(dev), init.to(dev)
    o1, f1 = fla(qc, kc, vc, ac, bc, A_c, dt_c, init_c, ix.cu_seqlens, cu, ix.chunk_indices, FLA_CHUNK)
    o2, f2 = fla(*cuda(l2norm(q.float()), l2norm(k.float())), vc, ac, bc, A_c, dt_c, init_c, ix.cu_seqlens, cu,
                 ix.chunk_indices, FLA_CHUNK, qk_normed=True)
    gg, beta = gdn_gating(A_c, ac, dt_c, bc)
    o3, f3 = fla.public(qc[None], kc[None], vc[None], g=gg[None], beta=beta[None], scale=d ** -0.5,
                        initial_state=init_c, output_final_state=True, cu_seqlens=ix.cu_seqlens,
                        chunk_indices=ix.chunk_indices, chunk_size=FLA_CHUNK, use_qk_l2norm_in_kernel=True)
    for o, f in ((o1, f1), (o2, f2)):
        assert torch.allclose(o.float(), o3[0].float(), atol=3e-2, rtol=3e-2)
        assert torch.allclose(f, f3, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens,heads", [(1, 32), (77, 6), (300, 48)])
def test_prefill_gates_equal_torch(dev, tokens, heads):
    """The prefill's gate inputs from strided views of the input projection: a copied as it is, beta = sigmoid(b)
    in float32 (row counts that are not multiples of the block, head counts that are not powers of two)."""
    from hylo.ops.gdn_triton import prefill_gates

    proj = torch.randn(tokens, 5 + 2 * heads, generator=torch.Generator().manual_seed(tokens)).to(dev, torch.bfloat16)
    b, a = proj[:, 5:5 + heads], proj[:, 5 + heads:]
    a_out, beta = prefill_gates(a, b)
    assert a_out.is_contiguous() and torch.equal(a_out, a)
    assert beta.dtype == torch.float32
    torch.testing.assert_close(beta, b.float().sigmoid(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel,cfg", [(4, None), (4, (4, 64, 2)), (3, None)])
def test_conv_prefill_with_bias_matches_reference(dev, kernel, cfg):
    """Mamba2's conv has a bias: the walking kernel (width 4) and the 2D kernel add it before the SiLU."""
    from hylo.ops.conv1d_triton import conv_prefill

    g = torch.Generator().manual_seed(10)
    lens, channels = [7, 1, 20], 256
    x = torch.randn(sum(lens), channels, generator=g)
    w = torch.randn(channels, kernel, generator=g)
    bias = torch.randn(channels, generator=g)
    pool = torch.randn(5, channels, kernel - 1, generator=g)
    slots = torch.tensor([3, -1, 1])
    qsl = torch.tensor([0] + lens).cumsum(0)
    dpool = pool.clone().to(dev)
    out = conv_prefill(x.to(dev), w.to(dev), dpool, slots.to(dev), qsl.to(dev), lens, cfg=cfg, bias=bias.to(dev))
    for b, (s, n) in enumerate(zip(slots.tolist(), lens)):
        ro, rs = conv_ref.causal_conv1d_ref(x[qsl[b]:qsl[b] + n], pool[s] if s >= 0 else None, w, bias)
        assert torch.allclose(out[qsl[b]:qsl[b] + n].cpu(), ro, atol=1e-4, rtol=1e-4)
        if s >= 0:
            assert torch.allclose(dpool[s].cpu(), rs, atol=1e-6)
