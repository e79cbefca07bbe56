"""The MoE routing Triton kernel against its torch reference, from the router's logits and from the router GEMV's
split-K partials."""

import pytest
import torch

from hylo.ops.moe import route_topk


@pytest.mark.parametrize("tokens,experts,top_k,normalize,shared", [(1, 64, 10, True, True), (7, 8, 2, False, False),
                                                                   (33, 16, 3, True, False), (5, 40, 6, True, True),
                                                                   (3, 512, 10, True, True)])  # 512: Qwen3-Next-80B
def test_routing_kernel_matches_reference(dev, tokens, experts, top_k, normalize, shared):
    from hylo.ops.moe_route_triton import route

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(tokens, experts + int(shared), generator=g)
    logits[0, 1:4] = logits[0, 0]  # ties go to the lower id, as torch.topk breaks them
    w, ids = route(logits.to(dev), experts, top_k, normalize, shared)
    rw, rids = route_topk(logits[:, :experts], top_k, normalize)
    assert torch.equal(ids[:, :top_k].cpu(), rids)
    assert torch.allclose(w[:, :top_k].cpu(), rw, atol=1e-6)
    if shared:
        assert (ids[:, top_k] == experts).all()
        assert torch.allclose(w[:, top_k].cpu(), torch.sigmoid(logits[:, experts]), atol=1e-6)


@pytest.mark.parametrize("tokens,split", [(1, 8), (5, 2), (16, 4)])
def test_router_gemv_partials_route_like_the_plain_logits(dev, tokens, split):
    """The decode router: split-K partials from ``ops.linear.narrow`` route exactly as the rounded logits do."""
    from hylo.ops.linear import narrow
    from hylo.ops.moe_route_triton import route

    experts, top_k, hidden = 64, 10, 2048
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the interpreter has no bfloat16 dot
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g).to(dev, dt)
    router = (torch.randn(experts + 1, hidden, generator=g) * 0.05).to(dev, dt)
    partials = narrow(x, router)
    assert partials.dim() == 3 and partials.dtype == torch.float32
    logits = partials[:, 0]
    for i in range(1, partials.shape[1]):  # in the kernel's order, so that the rounding to dt is the same
        logits = logits + partials[:, i]
    logits = logits.to(dt)
    assert torch.allclose(logits.float(), (x.float() @ router.float().T), atol=0.05, rtol=0.02)
    w, ids = route(partials, experts, top_k, True, True, dt)
    rw, rids = route(logits, experts, top_k, True, True)
    assert w.dtype == dt
    assert torch.equal(ids, rids)
    assert torch.allclose(w.float(), rw.float(), atol=1e-2)
    # the split itself: same partials laid out with a non-default split count still sum to the logits
    sp = torch.randn(tokens, split, experts + 1, generator=g).to(dev)
    w2, ids2 = route(sp, experts, top_k, False, True, dt)
    summed = sp[:, 0]
    for i in range(1, split):  # in the kernel's order, so that the rounding to dt is the same
        summed = summed + sp[:, i]
    rw2, rids2 = route(summed.to(dt), experts, top_k, False, True)
    assert torch.equal(ids2, rids2) and torch.equal(w2, rw2)


def test_prefill_router_logits_through_padded_weight(dev):
    """Many rows (prefill): ``narrow`` multiplies by a copy of the 65-row router padded to 72 rows (an aligned
    cuBLAS kernel) and hands back a strided view of the first 65 columns, which routes like the plain logits."""
    from hylo.ops.linear import narrow
    from hylo.ops.moe_route_triton import route

    experts, top_k, hidden, tokens = 64, 10, 256, 700
    g = torch.Generator().manual_seed(8)
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    router = (torch.randn(experts + 1, hidden, generator=g) * 0.05).to(dev)
    logits = narrow(x, router)
    assert logits.shape == (tokens, experts + 1)
    plain = x @ router.T
    assert torch.allclose(logits, plain, atol=1e-3, rtol=1e-3)
    w, ids = route(logits, experts, top_k, True, True)
    rw, rids = route(plain.contiguous(), experts, top_k, True, True)
    assert torch.equal(ids, rids) and torch.allclose(w, rw, atol=1e-5)


@pytest.mark.parametrize("tokens,experts,n_group,topk_group,top_k,normalize,shared",
                         [(1, 128, 1, 1, 6, True, 2), (9, 128, 8, 4, 8, True, 0), (5, 8, 4, 2, 3, False, 1),
                          (33, 72, 3, 2, 5, True, 0), (2, 40, 1, 1, 1, True, 3)])
def test_grouped_sigmoid_routing_matches_reference(dev, tokens, experts, n_group, topk_group, top_k, normalize,
                                                   shared):
    """Nemotron 3's routing kernel (sigmoid scores, the correction bias for the choice only, groups ranked by their
    two best biased scores, top-k, renormalised and scaled, then the folded shared expert's pairs) against the torch
    reference: the same experts per token and their weights; groups of 24 and 9 experts (not powers of two) among
    them."""
    from hylo.ops.moe import grouped_sigmoid_route
    from hylo.ops.moe_route_triton import grouped_sigmoid_route as route_triton

    g = torch.Generator().manual_seed(tokens * 7 + experts)
    logits = torch.randn(tokens, experts, generator=g)
    bias = torch.randn(experts, generator=g) * 0.3
    rw, rids = grouped_sigmoid_route(logits, bias, n_group, topk_group, top_k, normalize, 2.5, shared)
    given = logits
    if shared:  # the logits as split-K partial rows whose sum they are (the one-row router GEMV's output)
        parts = torch.randn(tokens, 3, experts, generator=g)
        given = torch.cat([parts, (logits - parts.sum(1))[:, None]], 1)
    w, ids = route_triton(given.to(dev), bias.to(dev), n_group, topk_group, top_k, normalize, 2.5, shared)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (tokens, top_k + shared)
    if shared:  # the shared expert's pairs last, whole weight
        assert torch.equal(rids[:, top_k:], torch.arange(experts, experts + shared).expand(tokens, shared))
        assert torch.equal(rw[:, top_k:], torch.ones(tokens, shared))
    order, rorder = ids.cpu().sort(1), rids.sort(1)
    assert torch.equal(order.values, rorder.values)
    torch.testing.assert_close(w.cpu().gather(1, order.indices), rw.gather(1, rorder.indices), rtol=1e-5, atol=1e-6)
    if n_group > 1:  # not vacuous: the group limit excludes experts the plain top-k would take
        plain = (logits.sigmoid() + bias).topk(top_k, dim=-1)[1].sort(1).values
        assert not torch.equal(plain, rids[:, :top_k].sort(1).values)


@pytest.mark.parametrize("tokens", [1, 3])
def test_router_logits_in_float32_from_the_models_dtype(dev, tokens):
    """Nemotron 3's float32 router on activations in the model's dtype: at one token the one-row GEMV's float32
    partial rows (their sum the float32 product), else the float32 matmul; the routing takes either."""
    from hylo.ops.moe import grouped_sigmoid_route, router_logits_f32

    g = torch.Generator().manual_seed(31)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x, gate = torch.randn(tokens, 2688, generator=g).to(dt), torch.randn(128, 2688, generator=g) * 0.02
    ref = x.float() @ gate.T
    out = router_logits_f32(x.to(dev), gate.to(dev))
    if tokens == 1:
        assert out.dim() == 3 and out.shape[1] > 1
    got = out.sum(1) if out.dim() == 3 else out
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)
    bias = torch.randn(128, generator=g) * 0.1
    _, ids = grouped_sigmoid_route(out, bias.to(dev), 1, 1, 6, True, 2.5, 2)
    _, ref_ids = grouped_sigmoid_route(ref, bias, 1, 1, 6, True, 2.5, 2)
    assert torch.equal(ids.cpu().sort(1).values, ref_ids.sort(1).values)
