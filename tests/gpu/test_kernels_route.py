"""The MoE routing Triton kernels against their torch references: the routing kernel, the router GEMV's split-K
partials, the fused router launches and the routing inside the gate/up kernel."""

import pytest
import torch

from hylo.ops.moe import route_topk


@pytest.mark.parametrize("ranked", [False, True])
@pytest.mark.parametrize("tokens,experts,top_k,normalize,shared", [(1, 64, 10, True, True), (7, 8, 2, False, False),
                                                                   (33, 16, 3, True, False), (5, 40, 6, True, True)])
def test_routing_kernel_matches_reference(dev, tokens, experts, top_k, normalize, shared, ranked, monkeypatch):
    from hylo.ops import moe_route_triton
    from hylo.ops.moe_route_triton import route

    monkeypatch.setattr(moe_route_triton, "ROUTE_RANKED", ranked)
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


def _skip_bf16_dot_in_interpreter(dev, dtype):
    """Triton 3.6's interpreter computes ``tl.dot`` of bfloat16 tiles wrongly (values of 1e11 for products of
    order 1), and the fused router's GEMV is such a dot: those cases run on the GPU only."""
    if dev.type != "cuda" and dtype == torch.bfloat16:
        pytest.skip("bfloat16 tl.dot is wrong in Triton's interpreter; runs on the GPU")


def _assert_top_experts(ids, x, router, experts, top_k):
    """The routed experts are the top-k of the plain float32 router logits (as a set: rounding may swap the order
    of two nearly equal ones)."""
    logits = torch.nn.functional.linear(x.float(), router[:experts].float())
    ref = route_topk(logits, top_k, True)[1]
    assert torch.equal(ids[:, :top_k].sort(-1).values.cpu(), ref.sort(-1).values.cpu())


@pytest.mark.parametrize("tokens,shared,dtype", [(1, True, torch.bfloat16), (4, True, torch.float32),
                                                 (3, False, torch.bfloat16)])
def test_fused_router_routes_like_the_router_gemv_then_routing(dev, tokens, shared, dtype):
    """``router_route`` (the router GEMV and the routing in one launch, ``HYLO_FUSED_ROUTER=1``) against the two
    launches it replaces (the split GEMV's partials, then ``route``), twice in a row: the last program resets the
    count that picks it, so a second launch (a graph replay) routes again."""
    from hylo.ops.linear import narrow
    from hylo.ops.moe_route_triton import route, router_route

    _skip_bf16_dot_in_interpreter(dev, dtype)
    experts, top_k, hidden = 64, 10, 512
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
    router = (torch.randn(experts + int(shared), hidden, generator=g) * 0.05).to(dtype).to(dev)
    rw, rids = route(narrow(x, router), experts, top_k, True, shared, dtype)
    _assert_top_experts(rids, x, router, experts, top_k)
    for _ in range(2):
        w, ids = router_route(x, router, experts, top_k, True, shared)
        assert torch.equal(ids, rids)
        assert torch.allclose(w.float(), rw.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("tokens,per_row,dtype,hidden", [(1, 8, torch.bfloat16, 512), (4, 0, torch.float32, 384),
                                                         (3, 11, torch.bfloat16, 512)])
def test_fused_norm_router_equals_the_norm_then_the_router(dev, tokens, per_row, dtype, hidden):
    """``norm_router_route`` (the residual-add norm before the MoE, the router GEMV and the routing in one launch)
    against ``add_rms_norm`` and then the router GEMV and ``route``: the same new residual and normed rows, the
    same experts; ``per_row`` unreduced delta rows (0: a plain [M, H] delta); a hidden size that is not a power of
    two (384: the rows' norm pass masks its block)."""
    from hylo.ops.linear import narrow
    from hylo.ops.moe_route_triton import norm_router_route, route
    from hylo.ops.norm_triton import add_rms_norm

    _skip_bf16_dot_in_interpreter(dev, dtype)
    experts, top_k = 64, 10
    g = torch.Generator().manual_seed(tokens + per_row)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
    shape = (tokens, per_row, hidden) if per_row else (tokens, hidden)
    delta = (torch.randn(shape, generator=g) * 0.5).to(torch.float32 if per_row else dtype).to(dev)
    nw = (torch.randn(hidden, generator=g) * 0.1).to(dtype).to(dev)
    router = (torch.randn(experts + 1, hidden, generator=g) * 0.05).to(dtype).to(dev)
    ref_res, ref_y = add_rms_norm(x, delta, nw, 1e-6)
    rw, rids = route(narrow(ref_y, router), experts, top_k, True, True, dtype)
    _assert_top_experts(rids, ref_y, router, experts, top_k)
    for _ in range(2):
        res, y, w, ids = norm_router_route(x, delta, nw, 1e-6, router, experts, top_k, True, True)
        assert torch.equal(res, ref_res)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(y.float(), ref_y.float(), atol=tol, rtol=tol)
        assert torch.equal(ids, rids)
        assert torch.allclose(w.float(), rw.float(), atol=tol)


@pytest.mark.parametrize("tokens,experts,top_k,normalize,shared,split,ties", [
    (1, 64, 10, True, True, 16, False), (3, 64, 10, True, True, 1, True), (2, 8, 3, False, False, 4, False),
    (4, 13, 2, True, False, 1, True)])
def test_routing_inside_the_gate_up_kernel_equals_the_routing_kernel(dev, tokens, experts, top_k, normalize, shared,
                                                                     split, ties):
    """``fused_moe_routed`` (each gate/up program ranks its token's experts from the router's logits, or from
    split-K partials) against the routing kernel then ``fused_moe``: the same experts (checked through the ids and
    weights it stores for the down projection) and the same output; exact ties go to the lower expert id."""
    from hylo.ops import moe_triton
    from hylo.ops.moe_route_triton import route
    from hylo.ops.moe_triton import fused_moe, fused_moe_routed

    g = torch.Generator().manual_seed(21)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hidden, inter, n = 64, 48, experts + int(shared)
    x = torch.randn(tokens, hidden, generator=g).to(dev, dt)
    w13 = (torch.randn(n, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dev, dt)
    w2 = (torch.randn(n, hidden, inter, generator=g) / inter ** 0.5).to(dev, dt)
    if split > 1:
        logits = torch.randn(tokens, split, n, generator=g).to(dev)
    else:
        logits = torch.randn(tokens, n, generator=g).to(dt)
        if ties:  # duplicates among the top experts and below them
            logits[:, 1] = logits[:, 0] = logits.max()
            logits[:, 5] = logits[:, 7]
        logits = logits.to(dev)
    weights, ids = route(logits, experts, top_k, normalize, shared, dt)
    seen = {}
    pair_moe = moe_triton._pair_moe

    def keep(x, w13, w2, ids_buf, wts_buf, *args):  # what the gate/up kernel stored for the down projection
        out = pair_moe(x, w13, w2, ids_buf, wts_buf, *args)
        seen.update(ids=ids_buf.clone(), wts=wts_buf.clone())
        return out

    moe_triton._pair_moe = keep
    try:
        out = fused_moe_routed(x, w13, w2, logits, experts, top_k, normalize, shared)
    finally:
        moe_triton._pair_moe = pair_moe
    assert torch.equal(seen["ids"].view(tokens, -1).cpu(), ids.cpu())
    assert torch.allclose(seen["wts"].view(tokens, -1).float().cpu(), weights.float().cpu(), rtol=1e-2, atol=1e-6)
    ref = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == ref.dtype
    assert torch.allclose(out.float().cpu(), ref.float().cpu(), rtol=2e-2, atol=2e-3)
