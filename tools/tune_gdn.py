"""Sweeps of the GDN kernels (the prefill conv, the decode / verify / replay step kernels and the step conv) and the
timing of the sampled-row draw, on bench-6b shapes (``tune_kernels.py --only conv steps sampling``)."""

import itertools

import torch

from hylo.ops.conv1d_triton import conv_steps
from hylo.ops.gdn_triton import gdn_steps, replay_commit
from tune_common import COPY_TBPS, sweep, time_eager


def tune_conv_prefill(dev, dt, results, tokens=8192):
    """The GDN prefill conv (q | k | v planes, read from the fused projection's rows), eager, against its bytes."""
    from hylo.ops.conv1d_triton import conv_prefill

    kd, vd, width = 2048, 4096, 4
    channels = 2 * kd + vd
    proj = torch.randn(tokens, channels + vd + 64, device=dev, dtype=dt)
    x = proj[:, :channels]
    w = torch.randn(channels, width, device=dev, dtype=dt)
    pool = torch.zeros(4, channels, width - 1, device=dev, dtype=dt)
    slots = torch.tensor([1], device=dev)
    qsl = torch.tensor([0, tokens], device=dev)
    rows = torch.zeros(tokens, dtype=torch.long, device=dev)
    floor = 2 * tokens * channels * 2 / COPY_TBPS / 1e6
    # the 2D kernel's best shapes of run -1246, then the walking kernel (each input loaded once)
    cfgs = [(4, 256, 4), (16, 64, 4), (32, 128, 4)]
    cfgs += [(bt, bc, w_, 1) for bt in (16, 32, 64) for bc in (256, 512, 1024) for w_ in (2, 4)]
    rows_out = []
    for cfg in cfgs:
        try:
            us = time_eager(lambda: conv_prefill(x, w, pool, slots, qsl, [tokens], rows, (kd, kd), cfg=cfg)) * 1e3
        except Exception as exc:
            print(f"  conv {cfg}: failed ({type(exc).__name__})")
            continue
        rows_out.append((us, cfg))
    rows_out.sort()
    results["conv_prefill"] = {"floor_us": floor, "rows": [{"us": us, "cfg": list(c)} for us, c in rows_out]}
    print(f"conv_prefill {tokens}: floor {floor:.1f} us; " + "; ".join(f"{c} {us:.1f}" for us, c in rows_out[:6]),
          flush=True)


def tune_steps(dev, dt, results, gdn_layers=18, hk=16, hv=32, d=128, width=4):
    """The GDN decode / verify step kernels (conv, then the recurrent step with its float32 state by slot) at
    bench-6b's shapes (16 key / 32 value heads of 128, conv over 8192 channels of width 4), one state pool per
    layer; a verify (S = 4) keeps its inputs, as the default replay commit has it, and the replay commit (every
    layer in one launch, two accepted drafts per row: accept length 3) is swept beside it. cfg: (value channels or
    conv channels per program, warps)."""
    conv_dim = (2 * hk + hv) * d
    state = hv * d * d * 4
    for bs, steps in ((1, 1), (8, 1), (64, 1), (1, 4), (8, 4), (64, 4)):
        rows = bs * steps
        slots = torch.arange(bs, device=dev)
        rec = torch.zeros(gdn_layers, bs, hv, d, d, device=dev, dtype=torch.float32)
        conv = [torch.zeros(bs, conv_dim, width - 1, device=dev, dtype=dt) for _ in range(gdn_layers)]
        verify_conv = torch.empty(bs, steps, conv_dim, width - 1, device=dev, dtype=dt) if steps > 1 else None
        x = torch.randn(gdn_layers, rows, conv_dim, device=dev, dtype=dt)
        ab = torch.randn(gdn_layers, rows, 2, hv, device=dev, dtype=dt)
        kept_ab = torch.empty(rows, 2, hv, device=dev, dtype=dt) if steps > 1 else None
        A_log, dt_bias = torch.randn(gdn_layers, hv, device=dev, dtype=dt), torch.randn(gdn_layers, hv, device=dev,
                                                                                         dtype=dt)
        accepted = torch.full((bs,), min(2, steps - 1), device=dev, dtype=torch.long)
        cw = torch.randn(conv_dim, width, device=dev, dtype=dt)

        def gdn(cfg):
            def fn():
                for layer in range(gdn_layers):
                    gdn_steps(x[layer], ab[layer, :, 0], ab[layer, :, 1], A_log[layer], dt_bias[layer], rec[layer],
                              slots, hk, d, d, steps, cfg=cfg, keep_ab=kept_ab)
            return fn

        def replay(cfg):
            return lambda: replay_commit(x, ab, A_log, dt_bias, rec, slots, accepted, hk, d, d, steps, cfg=cfg)

        def cv(cfg):
            def fn():
                for layer in range(gdn_layers):
                    conv_steps(x[layer], cw, conv[layer], slots, steps, verify_conv, cfg=cfg)
            return fn

        tiles = list(itertools.product((16, 32, 64, 128), (2, 4, 8)))
        # floors per layer: decode reads and writes each state, a verify reads it, the replay reads and writes it
        sweep(f"gdn_steps_b{bs}_s{steps}", tiles, gdn, bs * state * (2 if steps == 1 else 1) / COPY_TBPS / 1e6,
              results, layers=gdn_layers)
        if steps > 1:
            sweep(f"gdn_replay_b{bs}_s{steps}", tiles, replay, bs * state * 2 / COPY_TBPS / 1e6, results,
                  layers=gdn_layers)
        sweep(f"conv_steps_b{bs}_s{steps}", list(itertools.product((64, 128, 256, 512), (1, 2, 4))), cv,
              max(rows * conv_dim * 2 * 2 / COPY_TBPS / 1e6, 1e-3), results, layers=gdn_layers)


def time_sampling(dev, dt, results, vocab=151936):
    """The draw of sampled rows, the fused Triton pass against the torch form (the [B, V] noise, then the race), at
    batch 1, 8 and 64 over bench-6b's vocabulary; the floor reads the float32 probabilities once."""
    from hylo.ops.sampling import draw_ref
    from hylo.ops.sampling_triton import draw_triton

    for bs in (1, 8, 64):
        probs = torch.softmax(torch.randn(bs, vocab, device=dev), -1)
        seeds, steps = torch.arange(bs, device=dev) * 7919, torch.arange(bs, device=dev) + 11
        same = torch.equal(draw_triton(probs, seeds, steps), draw_ref(probs, seeds, steps))
        fused = time_eager(lambda: draw_triton(probs, seeds, steps)) * 1e3
        torch_us = time_eager(lambda: draw_ref(probs, seeds, steps)) * 1e3
        floor = bs * vocab * 4 / COPY_TBPS / 1e6
        results[f"draw_b{bs}"] = {"floor_us": floor, "fused_us": fused, "torch_us": torch_us, "same_tokens": same}
        print(f"draw b{bs}: fused {fused:.1f} us, torch {torch_us:.1f} us, floor {floor:.1f} us; same tokens: {same}",
              flush=True)
