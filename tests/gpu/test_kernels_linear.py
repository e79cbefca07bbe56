"""The few-row GEMV (decode projections) and the unreduced-rows residual add against their torch references."""

import pytest
import torch
import torch.nn.functional as F

from hylo.ops.norm import add_rms_norm, rms_norm_ref


def _dtype(dev):
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


@pytest.mark.parametrize("rows,n,k,split,bias", [(1, 65, 2048, 1, False), (3, 100, 256, 2, True),
                                                 (16, 40, 64, 4, True), (5, 48, 200, 3, False),
                                                 (1, 2048, 4096, 4, False), (7, 30, 96, 1, True)])
def test_gemv_matches_linear(dev, rows, n, k, split, bias):
    from hylo.ops.linear_triton import gemv

    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, k, generator=g)
    w, b = torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)
    dt = _dtype(dev)
    ref = F.linear(x.to(dt).double(), w.to(dt).double(), b.to(dt).double() if bias else None)
    y = gemv(x.to(dev, dt), w.to(dev, dt), b.to(dev, dt) if bias else None, split=split)
    if split == 1:
        assert y.shape == (rows, n) and y.dtype == dt
    else:
        assert y.shape == (rows, split, n) and y.dtype == torch.float32
        y = y.sum(1)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    assert (y.double().cpu() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("n,k,split,bias,norm", [(65, 2048, 1, False, False), (100, 256, 2, True, False),
                                                  (2048, 4096, 4, False, False), (40, 96, 1, True, False),
                                                  (48, 4 * 64, 4, False, True), (24, 2 * 32, 1, False, True),
                                                  (100, 32 * 32, 2, True, True)])
def test_one_row_gemv_on_the_cuda_cores(dev, n, k, split, bias, norm):
    """The batch-1 variant (``fma=True``: one row, no tensor-core padding) against the reference, with a K split,
    a bias, sizes that are not multiples of the tile, and the GDN gated norm (heads of 64 and 32; one head, two and
    sixteen per K block)."""
    from hylo.ops.linear_triton import gemv
    from hylo.ops.norm import gated_rms_norm

    g = torch.Generator().manual_seed(16)
    dt = _dtype(dev)
    x, z = torch.randn(1, k, generator=g).to(dt), torch.randn(1, k, generator=g).to(dt)
    w, b = (torch.randn(n, k, generator=g) / k ** 0.5).to(dt), torch.randn(n, generator=g).to(dt)
    dv = 64 if k == 256 else 32
    nw = (1 + 0.1 * torch.randn(dv, generator=g)).to(dt)
    xin = gated_rms_norm(x.view(1, -1, dv), z.view(1, -1, dv), nw, 1e-6).reshape(1, k) if norm else x
    ref = F.linear(xin.double(), w.double(), b.double() if bias else None)
    kw = dict(gate=z.to(dev), norm_weight=nw.to(dev), eps=1e-6) if norm else {}
    y = gemv(x.to(dev), w.to(dev), b.to(dev) if bias else None, split=split, fma=True, **kw)
    y = y.sum(1) if split > 1 else y
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    assert (y.double().cpu() - ref).norm() / ref.norm() < tol


def test_one_row_tile_rule_picks_the_measured_winners():
    """``fma_tile``'s rule (about 8 programs per SM) gives the tiles that won the H200 sweep
    (tune-fma-20261204-0501.json) for the four batch-1 projections of bench-6b (132 SMs, as a CPU device counts)."""
    from hylo.ops.linear_triton import fma_tile

    cpu = torch.device("cpu")
    assert fma_tile(12352, 1, 2048, cpu) == (16, 512, 4, 2)  # GDN input projection
    assert fma_tile(9216, 1, 2048, cpu) == (8, 512, 4, 2)  # attention qkv + gate
    assert fma_tile(2048, 4, 1024, cpu) == (8, 512, 4, 2)  # output projection, 4 splits
    assert fma_tile(2048, 8, 512, cpu)[0] == 16  # GDN output projection with its norm, 8 splits (BK = a head)


def test_gemv_refuses_a_gate_without_the_norm(dev):
    """The GEMV's input treatment is the GDN gated norm only (the attention gate moved into the attention merge):
    a gate alone is refused, not silently ignored."""
    from hylo.ops.linear_triton import gemv

    x = torch.randn(2, 32).to(dev, _dtype(dev))
    with pytest.raises(ValueError, match="gate"):
        gemv(x, torch.randn(8, 32).to(dev, _dtype(dev)), gate=x)


@pytest.mark.parametrize("rows,j,dim,plain", [(1, 11, 2048, False), (5, 4, 48, False), (3, 1, 20, False),
                                             (1, 4, 2688, True), (6, 1, 40, True)])
def test_add_rms_norm_sums_unreduced_rows(dev, rows, j, dim, plain):
    """Zero-centred (Qwen's) and plain (the Mamba2 families') weights."""
    from hylo.ops.norm import rms_norm_plain
    from hylo.ops.norm_triton import add_rms_norm as add_rms_norm_triton

    g = torch.Generator().manual_seed(13)
    x, parts = torch.randn(rows, dim, generator=g), torch.randn(rows, j, dim, generator=g)
    w = torch.randn(dim, generator=g)
    res, y = add_rms_norm_triton(x.to(dev), parts.to(dev), w.to(dev), 1e-6, plain)
    ref_res = x + parts.sum(1)
    norm = rms_norm_plain if plain else rms_norm_ref
    assert torch.allclose(res.cpu(), ref_res, atol=1e-5)
    assert torch.allclose(y.cpu(), norm(ref_res, w, 1e-6), atol=1e-4)
    ref_res2, ref_y2 = add_rms_norm(x, parts, w, 1e-6, plain)  # the CPU reference takes the same shapes
    assert torch.allclose(ref_res2, ref_res, atol=1e-5) and torch.allclose(ref_y2, y.cpu(), atol=1e-4)


@pytest.mark.parametrize("tokens,top_k", [(1, 11), (16, 11), (70, 3)])
@pytest.mark.parametrize("summed", [True, False])
def test_unreduced_moe_rows_sum_to_the_reduced_output(dev, tokens, top_k, summed, monkeypatch):
    """The unreduced MoE output: per pair (the grouped kernels, or the pair kernels with HYLO_PAIR_DOWN_SUM=0) or
    per token (the pair kernels' summing down projection); either way its rows sum to the reduced output."""
    from hylo.ops import moe_pairs_triton, moe_triton
    from hylo.ops.moe import fused_moe_ref, route_topk
    from hylo.ops.moe_triton import fused_moe

    monkeypatch.setattr(moe_pairs_triton, "PAIR_DOWN_SUM", summed)

    g = torch.Generator().manual_seed(14)
    experts, hidden, inter = 16, 64, 40
    dt = _dtype(dev)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = route_topk(torch.randn(tokens, experts, generator=g), top_k, True)
    args = (x.to(dev, dt), w13.to(dev, dt), w2.to(dev, dt), weights.to(dev, dt), ids.to(dev))
    rows = fused_moe(*args, reduce=False)
    pair_kernels = tokens * top_k <= moe_triton.PAIR_GEMV_MAX_PAIRS
    assert rows.shape == (tokens, 1 if summed and pair_kernels else top_k, hidden)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    tol = 3e-2 if dt == torch.bfloat16 else 1e-4
    assert (rows.double().sum(1).cpu() - ref).norm() / ref.norm() < tol
    assert (fused_moe(*args).double().cpu() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("rows,heads,dv,n", [(1, 32, 128, 2048), (4, 3, 32, 40), (13, 2, 64, 24)])
def test_gated_norm_fused_into_the_projection(dev, rows, heads, dv, n):
    """The GDN output path: gated RMSNorm of each head applied in the GEMV's loads, the gate read in place from
    a wider projection, against the unfused norm then matmul."""
    from hylo.ops.linear import norm_out_proj
    from hylo.ops.norm import gated_rms_norm

    g = torch.Generator().manual_seed(15)
    dt = _dtype(dev)
    x = torch.randn(rows, heads, dv, generator=g).to(dt)
    proj = torch.randn(rows, heads * dv + 7, generator=g).to(dt)
    z = proj[:, 7:].reshape(rows, heads, dv)
    nw = (1 + 0.1 * torch.randn(dv, generator=g)).to(dt)
    w = (torch.randn(n, heads * dv, generator=g) / (heads * dv) ** 0.5).to(dt)
    ref = F.linear(gated_rms_norm(x, z, nw, 1e-6).reshape(rows, -1).double(), w.double())
    zd = proj.to(dev)[:, 7:].reshape(rows, heads, dv)
    y = norm_out_proj(x.to(dev), zd, nw.to(dev), 1e-6, w.to(dev))
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    assert y.shape == (rows, n)
    assert (y.double().cpu() - ref).norm() / ref.norm() < tol
    parts = norm_out_proj(x.to(dev), zd, nw.to(dev), 1e-6, w.to(dev), reduce=False)
    assert (parts.double().reshape(rows, -1, n).sum(1).cpu() - ref).norm() / ref.norm() < tol
    from hylo.ops.linear_triton import gemv

    for split in (1, heads):  # one program over all of K, or one head per split
        y = gemv(x.to(dev).reshape(rows, -1), w.to(dev), gate=zd.flatten(1), norm_weight=nw.to(dev), eps=1e-6,
                 split=split)
        y = y.sum(1) if split > 1 else y
        assert (y.double().cpu() - ref).norm() / ref.norm() < tol, split


@pytest.mark.parametrize("rows,n", [(40, 300), (3, 2048), (1, 20)])
def test_sigmoid_gate_matches_torch_on_a_strided_gate(dev, rows, n):
    """The prefill attention output gate: one kernel reading the gate in place from the projection, with torch's
    rounding (sigmoid rounded to the dtype, then the product)."""
    from hylo.ops.linear_triton import sigmoid_gate

    g = torch.Generator().manual_seed(12)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(rows, n, generator=g).to(dev, dtype)
    proj = torch.randn(rows, 3 * n + 5, generator=g).to(dev, dtype)
    gate = proj[:, n + 3:2 * n + 3]
    out = sigmoid_gate(x, gate)
    ref = x * torch.sigmoid(gate)
    if dtype == torch.float32:
        assert torch.allclose(out, ref, atol=1e-6, rtol=1e-6)
    else:  # torch computes the bf16 sigmoid through float32 too: the same rounding points
        assert (out.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()


@pytest.mark.parametrize("rows,n,inter,split,fma", [(1, 48, 80, 1, True), (1, 4096 // 8, 12288 // 8, 4, True),
                                                    (3, 64, 200, 2, False), (16, 40, 96, 4, False),
                                                    (1, 33, 72, 2, False)])
def test_swiglu_down_gemv_matches_the_reference(dev, rows, n, inter, split, fma):
    """The dense MLP's down projection with silu(gate) * up computed in the GEMV's loads, against swiglu_ref and a
    float64 matmul: one row on the CUDA cores and padded rows on the tensor cores, K splits, odd sizes."""
    from hylo.ops.linear import swiglu_ref
    from hylo.ops.linear_triton import gemv

    g = torch.Generator().manual_seed(21)
    dt = _dtype(dev)
    h = (torch.randn(rows, 2 * inter, generator=g) * 2).to(dt)
    w = (torch.randn(n, inter, generator=g) / inter ** 0.5).to(dt)
    ref = F.linear(swiglu_ref(h).double(), w.double())
    y = gemv(h.to(dev), w.to(dev), split=split, fma=fma, swiglu=True)
    y = y.sum(1) if split > 1 else y
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    assert (y.double().cpu() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("rows,inter", [(1, 80), (37, 1500), (5, 12288)])
def test_silu_mul_matches_the_reference(dev, rows, inter):
    from hylo.ops.linear import swiglu, swiglu_ref

    g = torch.Generator().manual_seed(22)
    dt = _dtype(dev)
    h = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dt)
    y = swiglu(h.to(dev)).cpu()
    assert y.shape == (rows, inter) and y.dtype == dt
    torch.testing.assert_close(y, swiglu_ref(h), rtol=1e-2 if dt == torch.bfloat16 else 1e-6, atol=1e-6)


def test_dense_mlp_layer_few_and_many_rows(dev):
    """layers.moe.MLP on the few-row path (unreduced split-K rows, summed) and the many-row path against the plain
    torch formula."""
    from hylo.layers.moe import MLP

    g = torch.Generator().manual_seed(23)
    dt = _dtype(dev)
    mlp = MLP(64, 160, dt, dev)
    with torch.no_grad():
        mlp.gate_up.copy_((torch.randn(320, 64, generator=g) / 8).to(dt))
        mlp.down.copy_((torch.randn(64, 160, generator=g) / 12).to(dt))
    for rows in (1, 4, 40):
        x = torch.randn(rows, 64, generator=g).to(dt)
        h = F.linear(x.double(), mlp.gate_up.double().cpu())
        ref = F.linear(F.silu(h[:, :160]) * h[:, 160:], mlp.down.double().cpu())
        y = mlp(x.to(dev), reduce=False)
        y = y.sum(1) if y.dim() == 3 else y
        tol = 3e-2 if dt == torch.bfloat16 else 1e-5
        assert (y.double().cpu() - ref).norm() / ref.norm() < tol, rows
