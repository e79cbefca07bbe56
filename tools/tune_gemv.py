"""Sweeps of the few-row GEMV on bench-6b's dense projections at decode batch sizes: against cuBLAS
(``F.linear``), split-K for the output projections, the input treatments in the GEMV's loads (the GDN gated norm),
and the one-row CUDA-core GEMV of batch 1 (``tune_kernels.py --only gemv split gates fma``)."""

import itertools

import torch
import torch.nn.functional as F

from hylo.ops.linear_triton import gemv
from tune_common import COPY_TBPS, LAYERS, sweep


def tune_gemv(dev, dt, results):
    for n, k in ((2048, 4096), (12352, 2048), (9216, 2048), (65, 2048), (151936 // 8, 2048)):
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
        for rows in (1, 8):
            x = torch.randn(rows, k, device=dev, dtype=dt)
            floor = n * k * 2 / COPY_TBPS / 1e6

            def cublas(cfg):
                def fn():
                    for w in ws:
                        F.linear(x, w)
                return fn

            def tri(cfg):
                def fn():
                    for w in ws:
                        gemv(x, w, cfg=cfg)
                return fn
            sweep(f"cublas_{n}x{k}_m{rows}", [("F.linear",)], cublas, floor, results)
            sweep(f"gemv_{n}x{k}_m{rows}", list(itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4))),
                  tri, floor, results)
        ws = None
        torch.cuda.empty_cache()


def tune_split(dev, dt, results):
    """The output projections (2048 x 4096) as split-K GEMVs left unreduced; cfg = (BN, BK, warps, stages, split)."""
    n, k = 2048, 4096
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    floor = n * k * 2 / COPY_TBPS / 1e6
    for rows in (1, 4, 8):
        x = torch.randn(rows, k, device=dev, dtype=dt)

        def tri(cfg):
            def fn():
                for w in ws:
                    gemv(x, w, split=cfg[4], cfg=cfg[:4])
            return fn
        cfgs = [c + (sp,) for c in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4)) for sp in (2, 4, 8)]
        sweep(f"split_gemv_{n}x{k}_m{rows}", cfgs, tri, floor, results)


def tune_gates(dev, dt, results):
    """The output projections with what they apply to their input inside their loads: none (the attention's, whose
    gate moved into the attention merge after this sweep measured it at 13.4 us against 6.0 at batch 1), the GDN
    gated norm of each 128-channel head; at a few splits and tiles. What the input's treatment costs the stream."""
    n, k = 2048, 4096
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    nw = torch.rand(128, device=dev, dtype=dt) + 0.5
    floor = n * k * 2 / COPY_TBPS / 1e6
    for rows in (1, 8):
        x = torch.randn(rows, k, device=dev, dtype=dt)
        g = torch.randn(rows, k, device=dev, dtype=dt)
        for kind, kw in (("none", {}), ("norm", dict(gate=g, norm_weight=nw))):
            def tri(cfg, kw=kw):
                def fn():
                    for w in ws:
                        gemv(x, w, split=cfg[4], cfg=cfg[:4], **kw)
                return fn
            cfgs = [c + (sp,) for c in itertools.product((32, 64), (128,), (4, 8), (4,)) for sp in (4, 8)]
            sweep(f"gate_{kind}_{n}x{k}_m{rows}", cfgs, tri, floor, results)


def tune_fma(dev, dt, results):
    """Batch 1: the decode projections as the tensor-core GEMV with its default tiles (the row whose last entry is
    0) against the one-row CUDA-core variant (``HYLO_GEMV_FMA``) over a few tiles; cfg = (BN, BK, warps,
    stages, split, fma). The GDN input and attention qkv projections unsplit, the output projection at the split
    the model uses (4 plain, 8 with the GDN norm)."""
    from hylo.ops.linear_triton import GEMV_CFG, SPLIT_GEMV_CFG

    nw = torch.rand(128, device=dev, dtype=dt) + 0.5
    for n, k, split, norm in ((12352, 2048, 1, False), (9216, 2048, 1, False), (2048, 4096, 4, False),
                              (2048, 4096, 8, True)):
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
        x, g = torch.randn(1, k, device=dev, dtype=dt), torch.randn(1, k, device=dev, dtype=dt)
        kw = dict(gate=g, norm_weight=nw) if norm else {}

        def tri(cfg, kw=kw):
            def fn():
                for w in ws:
                    gemv(x, w, split=cfg[4], cfg=cfg[:4], fma=bool(cfg[5]), **kw)
            return fn
        tc = (GEMV_CFG if split == 1 else SPLIT_GEMV_CFG) + (split, 0)
        fma = [c + (split, 1) for c in itertools.product((8, 16, 32), (128,) if norm else (128, 256, 512), (4,),
                                                         (2,))]
        sweep(f"fma_{n}x{k}{'_norm' if norm else ''}", [tc] + fma, tri, n * k * 2 / COPY_TBPS / 1e6, results)
        ws = None
        torch.cuda.empty_cache()
