"""The W8A16 kernels (block-FP8 weights dequantized as they are loaded) against the reference: the same projection or
MoE with the weight dequantized whole (``Fp8Weight.dequantize``), in float64."""

import pytest
import torch
import torch.nn.functional as F

from hylo.ops.fp8 import Fp8Weight, quantize_fp8_block
from hylo.ops.moe import fused_moe_ref, route_topk


def _dtype(dev):
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def _fp8(w: torch.Tensor, block, dev) -> Fp8Weight:
    q, scale = quantize_fp8_block(w, block)
    return Fp8Weight(q.to(dev), scale.to(dev), block)


def _close(out, ref, dt):
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    assert (out.double().cpu() - ref).norm() / ref.norm() < tol


@pytest.mark.parametrize("rows,n,k,block,bias", [(17, 100, 256, (128, 128), True), (64, 256, 512, (128, 128), False),
                                                 (40, 70, 200, (32, 64), True), (200, 48, 96, (16, 32), False)])
def test_fp8_matmul_matches_the_dequantized_weight(dev, rows, n, k, block, bias):
    from hylo.ops.fp8_triton import fp8_matmul

    g = torch.Generator().manual_seed(21)
    dt = _dtype(dev)
    x = torch.randn(rows, k, generator=g).to(dt)
    w = _fp8(torch.randn(n, k, generator=g) / k ** 0.5, block, dev)
    b = torch.randn(n, generator=g).to(dt)
    ref = F.linear(x.double(), w.dequantize(dt).double().cpu(), b.double() if bias else None)
    y = fp8_matmul(x.to(dev), w, b.to(dev) if bias else None)
    assert y.shape == (rows, n) and y.dtype == dt
    _close(y, ref, dt)


@pytest.mark.parametrize("rows,n,k,split,block,fma,mode", [
    (1, 65, 2048, 1, (128, 128), True, None), (1, 2048, 4096, 4, (128, 128), True, None),
    (3, 100, 256, 2, (128, 128), False, None), (16, 40, 384, 3, (64, 128), False, None),
    (1, 48, 4 * 128, 4, (128, 128), True, "norm"), (5, 48, 2 * 128, 1, (128, 128), False, "norm"),
    (1, 64, 256, 2, (128, 64), True, "swiglu"), (4, 30, 96, 1, (32, 32), False, "swiglu"),
    (1, 50, 300, 1, (32, 64), True, None), (1, 40, 1000, 2, (16, 128), True, None)])
@pytest.mark.parametrize("widen", [1, 2])
def test_fp8_gemv_matches_the_dequantized_weight(dev, rows, n, k, split, block, fma, mode, widen, monkeypatch):
    """The decode GEMV on FP8 weights: one row on the CUDA cores (its K tiles spanning several column blocks, past
    the last one too; as wide as bfloat16's, and twice: ``HYLO_FP8_ROW_WIDEN``) and several on the tensor cores, K
    splits that start on block boundaries, partial blocks, the GDN gated norm in the loads and the dense MLP's
    SwiGLU."""
    from hylo.ops import fp8_triton
    from hylo.ops.linear import swiglu_ref
    from hylo.ops.linear_triton import gemv
    from hylo.ops.norm import gated_rms_norm

    if widen > 1 and not fma:
        pytest.skip("the tensor-core GEMV's tiles stay inside a block")
    monkeypatch.setattr(fp8_triton, "FP8_ROW_WIDEN", widen)

    g = torch.Generator().manual_seed(22)
    dt = _dtype(dev)
    width = 2 * k if mode == "swiglu" else k
    x, z = torch.randn(rows, width, generator=g).to(dt), torch.randn(rows, k, generator=g).to(dt)
    w = _fp8(torch.randn(n, k, generator=g) / k ** 0.5, block, dev)
    nw = (1 + 0.1 * torch.randn(128, generator=g)).to(dt)
    if mode == "norm":
        xin = gated_rms_norm(x.view(rows, -1, 128), z.view(rows, -1, 128), nw, 1e-6).reshape(rows, k)
        kw = dict(gate=z.to(dev), norm_weight=nw.to(dev), eps=1e-6)
    elif mode == "swiglu":
        xin, kw = swiglu_ref(x), dict(swiglu=True)
    else:
        xin, kw = x, {}
    ref = F.linear(xin.double(), w.dequantize(dt).double().cpu())
    y = gemv(x.to(dev), w, split=split, fma=fma, **kw)
    y = y.sum(1) if split > 1 else y
    _close(y, ref, dt)


@pytest.mark.parametrize("rows,n,nt,k,split,block,fma", [
    (1, 300, 64, 2048, 1, (128, 128), True), (1, 130, 10, 1000, 2, (64, 128), True),
    (4, 96, 20, 384, 1, (128, 128), False), (16, 50, 33, 256, 2, (32, 64), False)])
def test_fp8_gemv_with_plain_tail_rows_in_the_same_launch(dev, rows, n, nt, k, split, block, fma):
    """The GDN input projection of an FP8 checkpoint: FP8 rows (q, k, v, z) and plain rows after them (b, a) in one
    launch, each part as its own GEMV computes it; tails and FP8 rows that end inside a program's block, K splits,
    one row and several. Through ``ops.linear.dense_pair`` the parts come back as views of one row."""
    from hylo.ops.linear import dense_pair
    from hylo.ops.linear_triton import gemv

    g = torch.Generator().manual_seed(25)
    dt = _dtype(dev)
    x = torch.randn(rows, k, generator=g).to(dt)
    w = _fp8(torch.randn(n, k, generator=g) / k ** 0.5, block, dev)
    t = (torch.randn(nt, k, generator=g) / k ** 0.5).to(dt)
    y = gemv(x.to(dev), w, split=split, fma=fma, tail=t.to(dev))
    y = y.sum(1) if split > 1 else y
    assert y.shape == (rows, n + nt)
    _close(y[:, :n], F.linear(x.double(), w.dequantize(dt).double().cpu()), dt)
    _close(y[:, n:], F.linear(x.double(), t.double()), dt)
    main, tail = dense_pair(x.to(dev), w, t.to(dev))
    assert main.shape == (rows, n) and tail.shape == (rows, nt)
    _close(tail, F.linear(x.double(), t.double()), dt)
    with pytest.raises(ValueError, match="tail rows"):
        gemv(x.to(dev), w, tail=t.to(dev)[:, :-1].contiguous())


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,block", [
    (1, 8, 2, 256, 128, (128, 128)), (3, 16, 4, 96, 64, (32, 32)), (70, 8, 3, 128, 64, (64, 64)),
    (40, 9, 2, 80, 48, (16, 32))])
@pytest.mark.parametrize("summed", [True, False])
def test_fp8_fused_moe_matches_the_dequantized_experts(dev, tokens, experts, top_k, hidden, inter, block, summed,
                                                       monkeypatch):
    """The pair kernels (few pairs) and the grouped kernels (many pairs) on FP8 experts, per-expert scales, partial
    blocks."""
    from hylo.ops import moe_pairs_triton
    from hylo.ops.moe_triton import fused_moe

    monkeypatch.setattr(moe_pairs_triton, "PAIR_DOWN_SUM", summed)
    g = torch.Generator().manual_seed(23)
    dt = _dtype(dev)
    x = torch.randn(tokens, hidden, generator=g).to(dt)
    w13 = _fp8(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5, block, dev)
    w2 = _fp8(torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5, block, dev)
    weights, ids = route_topk(torch.randn(tokens, experts, generator=g), top_k, True)
    ref = fused_moe_ref(x.double(), w13.dequantize(dt).double().cpu(), w2.dequantize(dt).double().cpu(),
                        weights.double(), ids)
    out = fused_moe(x.to(dev), w13, w2, weights.to(dev, dt), ids.to(dev))
    _close(out, ref, dt)


@pytest.mark.parametrize("cfg", [(16, 64, 128, 4, 3), (32, 128, 128, 8, 4, 128, 128, 8, 3),
                                 (16, 32, 128, 4, 3, 256, 64, 8, 3)])
@pytest.mark.parametrize("swap", [False, True])
def test_fp8_grouped_moe_with_its_own_table(dev, cfg, swap, monkeypatch):
    """FP8 experts take the grouped kernels' FP8 table (``GROUPED_FP8_CFG``), not the bfloat16 one: tiles as
    ``tools/tune_fp8.py`` sweeps them (BK a whole 128-column block, a down tile of its own, BN past H's end), with
    the dot's operands as they are or swapped (``GROUPED_FP8_SWAP``)."""
    from hylo.ops import moe_triton

    monkeypatch.setattr(moe_triton, "PAIR_GEMV_MAX_PAIRS", 0)
    monkeypatch.setattr(moe_triton, "GROUPED_FP8_SWAP", swap)
    monkeypatch.setattr(moe_triton, "GROUPED_FP8_CFG", ((1 << 62, cfg),))
    monkeypatch.setattr(moe_triton, "GROUPED_CFG", ((1 << 62, (3, 16, 16, 1, 1)),))  # BM = 3 cannot compile
    g = torch.Generator().manual_seed(5)
    dt = _dtype(dev)
    tokens, experts, top_k, hidden, inter = 37, 8, 3, 192, 128
    x = torch.randn(tokens, hidden, generator=g).to(dt)
    w13 = _fp8(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5, (128, 128), dev)
    w2 = _fp8(torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5, (128, 128), dev)
    weights, ids = route_topk(torch.randn(tokens, experts, generator=g), top_k, True)
    ref = fused_moe_ref(x.double(), w13.dequantize(dt).double().cpu(), w2.dequantize(dt).double().cpu(),
                        weights.double(), ids)
    _close(moe_triton.fused_moe(x.to(dev), w13, w2, weights.to(dev, dt), ids.to(dev)), ref, dt)


@pytest.mark.parametrize("n,k,block", [(300, 200, (128, 128)), (96, 512, (16, 32))])
def test_fp8_prefill_projection_dequantizes_the_weight_in_one_pass(dev, n, k, block):
    """At prefill sizes (``FP8_DEQUANT_ROWS`` rows and more) the projection is the weight dequantized by the Triton
    pass, bit for bit ``Fp8Weight.dequantize`` (partial blocks at both edges), times x by the BLAS."""
    from hylo.ops.fp8_triton import dequantize
    from hylo.ops.linear import FP8_DEQUANT_ROWS, linear

    g = torch.Generator().manual_seed(24)
    dt = _dtype(dev)
    w = _fp8(torch.randn(n, k, generator=g) / k ** 0.5, block, dev)
    assert torch.equal(dequantize(w, dt), w.dequantize(dt))
    x = torch.randn(max(FP8_DEQUANT_ROWS, 1), k, generator=g).to(dt)
    ref = F.linear(x.double(), w.dequantize(dt).double().cpu())
    _close(linear(x.to(dev), w), ref, dt)


def test_a_row_widening_that_is_not_a_power_of_two_is_refused_by_name(dev):
    """``HYLO_FP8_ROW_WIDEN`` multiplies a tile's columns, which stay a power of two: 3 is refused at import."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", "import hylo.ops.fp8_triton"], capture_output=True, text=True,
                          env={**os.environ, "HYLO_FP8_ROW_WIDEN": "3", "PYTHONPATH": root})
    assert proc.returncode != 0 and "HYLO_FP8_ROW_WIDEN=3: expected a power of two" in proc.stderr


def test_the_fp8_sweep_writes_settings_that_keep_the_prefill_tile():
    """``tools/tune_fp8.py``'s environment lines: the 64-token winner up to 1024 pairs, the 256-token one up to 4096,
    and past that the committed table's own last tile (the sweep measures no prefill size: applied there, session
    32's 256-token winner made the 35B prefill 50% slower); the swapped dot only where it took less time; the
    matmul tile best over both sizes. The lines parse back into the tables the kernels read."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import tune_fp8
    from hylo.ops import moe_triton as M

    small, large = [16, 32, 128, 4, 3, 64, 128, 4, 3], [16, 64, 128, 4, 4]
    def grouped(best, us):
        return {"best": best, "best_us": us, "rows": [{"us": us, "cfg": best[:5]}]}

    def matmul(a, b):  # the two tiles' times, each sweep's rows best first
        rows = [{"us": a, "cfg": [64, 64, 128, 4, 3]}, {"us": b, "cfg": [32, 64, 128, 4, 4]}]
        return {"rows": sorted(rows, key=lambda r: r["us"])}

    results = {"grouped_fp8_35b_t64": grouped(small, 268.6), "grouped_fp8_35b_t256": grouped(large, 322.2),
               "grouped_fp8_35b_t64_swap": grouped([16, 64, 128, 4, 3], 279.1),
               "grouped_fp8_35b_t256_swap": grouped([16, 64, 128, 4, 3], 336.0),
               "fp8_matmul_t64": matmul(56.9, 51.3), "fp8_matmul_t256": matmul(93.8, 112.7)}
    env = dict(line.removeprefix("export ").split("=", 1) for line in tune_fp8.fp8_env(results, "35b"))
    table = M.parse_grouped_cfg(env["HYLO_GROUPED_FP8_CFG"].strip("'"), "HYLO_GROUPED_FP8_CFG")
    assert table == ((1024, tuple(small)), (4096, tuple(large)), (1 << 62, M.GROUPED_FP8_CFG[-1][1]))
    assert env["HYLO_GROUPED_FP8_SWAP"] == "0"
    assert env["HYLO_FP8_MATMUL_CFG"] == "64,64,128,4,3"  # 1.11 + 1.00 of each size's best, against 1.00 + 1.20

    results["grouped_fp8_35b_t64_swap"]["best_us"] = 200.0  # the swapped dot now wins over both sizes together
    env = dict(line.removeprefix("export ").split("=", 1) for line in tune_fp8.fp8_env(results, "35b"))
    assert env["HYLO_GROUPED_FP8_SWAP"] == "1"
    assert M.parse_grouped_cfg(env["HYLO_GROUPED_FP8_CFG"].strip("'"))[0] == (1024, (16, 64, 128, 4, 3))
