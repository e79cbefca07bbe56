"""Fused MoE and norm Triton kernels against their torch references."""

import pytest
import torch

from hylo.ops.moe import fused_moe_ref, route_topk
from hylo.ops.norm import gated_rms_norm, rms_norm


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 8, 2, 48, 40), (3, 64, 10, 64, 32),
                                                                (37, 8, 3, 40, 24), (9, 64, 10, 96, 80)])
def test_fused_moe_matches_reference(dev, tokens, experts, top_k, hidden, inter):
    from hylo.ops.moe_triton import fused_moe

    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = route_topk(torch.randn(tokens, experts, generator=g), top_k, True)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    out = fused_moe(x.to(dev, dtype), w13.to(dev, dtype), w2.to(dev, dtype), weights.to(dev, dtype), ids.to(dev))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    assert (out.double().cpu() - ref).norm() / ref.norm() < tol


def test_align_pairs_blocks_hold_one_expert_each(dev):
    from hylo.ops.moe_triton import align_pairs

    ids = torch.randint(0, 8, (50, 3), generator=torch.Generator().manual_seed(4))
    sorted_pairs, block_expert = align_pairs(ids.to(dev), 8, 16)
    sp, be = sorted_pairs.cpu(), block_expert.cpu()
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(be.tolist()):
        pairs = sp[b * 16:(b + 1) * 16]
        real = pairs[pairs < flat.numel()]
        if e < 0:
            assert real.numel() == 0
            continue
        assert (flat[real] == e).all()
        seen.extend(real.tolist())
    assert sorted(seen) == list(range(flat.numel()))


@pytest.mark.parametrize("rows,dim", [(5, 48), (130, 2048), (3, 20)])
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
