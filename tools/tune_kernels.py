"""Launch-parameter sweeps on bench-6b shapes: the MoE pair kernels (gate/up and down, at 1, 8 and 16 tokens),
the few-row GEMV against cuBLAS (``F.linear``) for the dense projections and split-K for the output projections
(decode), and the grouped MoE GEMMs at an 8192-token prefill.

Decode measurements replay a CUDA graph of 24 calls over 24 different weight sets (one per layer, as in the model,
so nothing is served from L2) and report microseconds per call against the bytes-over-copy-rate floor of one call;
prefill ones time eager calls against the matmul-rate floor. The GDN sections (the prefill conv, the step kernels,
the sampled-row draw) live in ``tune_gdn.py``, the GEMV sweeps in ``tune_gemv.py``, the shared timing in
``tune_common.py``. Usage:
python tools/tune_kernels.py [--only moe pairs grouped gemv split gates fma gather prefill conv steps sampling]
[--out DIR] [--env FILE]; prints the best configurations and writes tune_kernels.json.
"""

import argparse
import itertools
import json
import os

from gpu_only import require

if __name__ == "__main__":  # one line, not a traceback, where there is no CUDA GPU or no Triton (tests import it)
    require("tools/tune_kernels.py")

import torch  # noqa: E402
import triton  # noqa: E402

from hylo.bench.floors import measure_matmul_rate  # noqa: E402
from hylo.ops import moe_grouped_mm as G  # noqa: E402
from hylo.ops import moe_pairs_triton as MP  # noqa: E402
from hylo.ops import moe_triton as M  # noqa: E402
from tune_common import (COPY_TBPS, E, H, I, LAYERS, TOP_K, kernel_split, overall_winner, routed_ids,  # noqa: E402
                         sweep, time_eager)
from tune_gdn import time_sampling, tune_conv_prefill, tune_steps  # noqa: E402
from tune_gemv import tune_fma, tune_gates, tune_gemv, tune_split  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", nargs="+", default=["moe", "gemv", "split"],
                    choices=["moe", "grouped", "gemv", "split", "gates", "fma", "gather", "prefill", "conv",
                             "steps", "sampling", "pairs"])
    ap.add_argument("--env", default=None, help="write the best settings found as shell exports to this file")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    results = {}
    sections = {"moe": tune_moe, "grouped": tune_grouped, "gemv": tune_gemv, "split": tune_split,
                "gates": tune_gates, "fma": tune_fma, "gather": tune_gather,
                "prefill": tune_prefill_moe, "conv": tune_conv_prefill, "steps": tune_steps,
                "sampling": time_sampling, "pairs": tune_pairs}
    for name in args.only:
        sections[name](dev, dt, results)
        # written after every section, so that a run cut short by a time limit keeps what it measured
        with open(os.path.join(args.out, "tune_kernels.json"), "w") as f:
            json.dump(results, f, indent=1)
        if args.env:  # the winners as environment settings, for a benchmark run right after the sweep
            with open(args.env, "w") as f:
                f.write("\n".join(tuned_env(results)) + "\n")


def tuned_env(results) -> list[str]:
    lines = []
    if "conv_prefill" in results:
        lines.append("export HYLO_CONV_PREFILL_CFG=" + ",".join(map(str, results["conv_prefill"]["rows"][0]["cfg"])))
    # the GDN step kernels and the decode / verify conv: the tile that does best over batch 1, 8 and 64 together
    for var, prefix in (("HYLO_GDN_DECODE_CFG", "gdn_steps_b{}_s1"), ("HYLO_GDN_VERIFY_CFG", "gdn_steps_b{}_s4"),
                        ("HYLO_GDN_REPLAY_CFG", "gdn_replay_b{}_s4"), ("HYLO_CONV_STEPS_CFG", "conv_steps_b{}_s1")):
        winner = overall_winner([results.get(prefix.format(bs)) for bs in (1, 8, 64)])
        if winner:
            lines.append(f"export {var}=" + ",".join(map(str, winner)))
    best = lambda name: results[name]["rows"][0]["us"] if name in results else float("inf")  # noqa: E731
    # the grouped kernels' table: the 64-token winner up to 1024 pairs, the 256-token one beyond
    cfg = lambda name: ",".join(map(str, results[name]["rows"][0]["cfg"]))  # noqa: E731
    if "grouped_down_t64" in results and "grouped_down_t256" in results:
        lines.append(f"export HYLO_GROUPED_CFG='1024:{cfg('grouped_down_t64')};max:{cfg('grouped_down_t256')}'")
    # the smallest swept size at which CUTLASS beats the Triton grouped kernels sets the threshold
    for tokens, pairs in ((64, 704), (256, 2816)):
        if best(f"grouped_mm_t{tokens}") < min(best(f"grouped_cfg_t{tokens}"), best(f"grouped_down_t{tokens}")):
            lines.append(f"export HYLO_GROUPED_MM_MIN_PAIRS={pairs}")
            break
    return lines


def expert_weights(dev, dt, layers=LAYERS):
    """bench-6b's routed experts plus the folded shared one, ``layers`` independent sets: (w13 list, w2 list)."""
    return ([torch.randn(E + 1, 2 * I, H, device=dev, dtype=dt) * 0.02 for _ in range(layers)],
            [torch.randn(E + 1, H, I, device=dev, dtype=dt) * 0.02 for _ in range(layers)])


def pair_case(tokens, dev, dt):
    """One decode size for the pair kernels: (pairs, each layer's routed ids, experts read per layer, pair
    weights, x, the activations, a float32 row per pair)."""
    P = tokens * (TOP_K + 1)
    ids = [routed_ids(tokens, dev).view(-1) for _ in range(LAYERS)]
    uniq = sum(int(i.unique().numel()) for i in ids) / LAYERS
    return (P, ids, uniq, torch.rand(P, device=dev, dtype=dt), torch.randn(tokens, H, device=dev, dtype=dt),
            torch.randn(P, I, device=dev, dtype=dt), torch.empty(P, H, device=dev, dtype=torch.float32))


def gate_up_runner(x, w13, ids, act):
    """cfg (BN, BK, warps, stages) -> a function launching the gate/up pair kernel once per layer."""
    def runner(cfg):
        bn, bk, warps, stages = cfg

        def fn():
            for layer in range(LAYERS):
                MP._pair_gate_up_kernel[(act.shape[0], triton.cdiv(I, bn))](
                    x, w13[layer], ids[layer], act, H, I, TOP_K=TOP_K + 1, BN=bn, BK=bk, num_warps=warps,
                    num_stages=stages)
        return fn
    return runner


def tune_moe(dev, dt, results):
    w13, w2 = expert_weights(dev, dt)
    for tokens in (1, 8, 16):
        P, ids, uniq, wts, x, act, out = pair_case(tokens, dev, dt)
        floor13 = uniq * 2 * I * H * 2 / COPY_TBPS / 1e6
        floor2 = uniq * I * H * 2 / COPY_TBPS / 1e6
        gate_up = gate_up_runner(x, w13, ids, act)

        def down(cfg):
            bn, bk, warps, stages = cfg

            def fn():
                for layer in range(LAYERS):
                    MP._pair_down_kernel[(P, triton.cdiv(H, bn))](act, w2[layer], ids[layer], wts, out, H, I,
                                                                 BN=bn, BK=bk, num_warps=warps, num_stages=stages)
            return fn

        gu_cfgs = list(itertools.product((4, 8, 16), (256, 512), (2, 4), (1, 3))) + [(2, 1024, 2, 1),
                                                                                   (4, 1024, 4, 1)]
        dn_cfgs = list(itertools.product((8, 16, 32), (256, 512), (2, 4), (1, 3))) + [(64, 128, 4, 3)]
        sweep(f"pair_gate_up_t{tokens}", gu_cfgs, gate_up, floor13, results)
        sweep(f"pair_down_t{tokens}", dn_cfgs, down, floor2, results)

        if tokens > 1:  # the grouped path at the same size, whole MoE (both kernels and the alignment)
            tw = wts.view(tokens, TOP_K + 1)

            def grouped(cfg):
                def fn():
                    saved = M.PAIR_GEMV_MAX_PAIRS
                    M.PAIR_GEMV_MAX_PAIRS = 0
                    for layer in range(LAYERS):
                        M.fused_moe(x, w13[layer], w2[layer], tw, ids[layer].view(tokens, -1), reduce=False)
                    M.PAIR_GEMV_MAX_PAIRS = saved
                return fn
            sweep(f"grouped_moe_t{tokens}", [("default",)], grouped, floor13 + floor2, results)


def tune_pairs(dev, dt, results):
    """The MoE pair kernels at decode sizes (1 and 8 tokens), after the summing down projection and the one-row
    GEMV's lesson (about 8 programs per SM, BK = 512, 2 stages did best): gate/up over tiles with 2 stages, and
    the down projection that sums a token's pairs itself (HYLO_PAIR_DOWN_SUM, the default) over its tiles against
    the one-row-per-pair kernel at its default tile (cfg ending in 0), whose rows the residual add then reads."""
    w13, w2 = expert_weights(dev, dt)
    for tokens in (1, 8):
        P, ids, uniq, wts, x, act, out = pair_case(tokens, dev, dt)
        gate_up = gate_up_runner(x, w13, ids, act)

        def down(cfg):
            bn, bk, warps, stages, summed = cfg

            def fn():
                for layer in range(LAYERS):
                    if summed:
                        MP._pair_down_sum_kernel[(tokens, triton.cdiv(H, bn))](
                            act, w2[layer], ids[layer], wts, out, H, I, TOP_K=TOP_K + 1, BN=bn, BK=bk,
                            num_warps=warps, num_stages=stages)
                    else:
                        MP._pair_down_kernel[(P, triton.cdiv(H, bn))](act, w2[layer], ids[layer], wts, out, H, I,
                                                                     BN=bn, BK=bk, num_warps=warps,
                                                                     num_stages=stages)
            return fn
        gu_cfgs = [MP.PAIR_GATE_UP_CFG] + list(itertools.product((2, 4, 8), (512, 1024), (2, 4), (2,)))
        sweep(f"pair_gate_up2_t{tokens}", gu_cfgs, gate_up, uniq * 2 * I * H * 2 / COPY_TBPS / 1e6, results)
        per_pair = next(cfg for limit, cfg in MP.PAIR_DOWN_CFG if P <= limit) + (0,)
        cfgs = [per_pair] + [c + (1,) for c in itertools.product((1, 2, 4, 8), (256, 512), (1, 2, 4), (1,))]
        sweep(f"pair_down_sum_t{tokens}", cfgs, down, uniq * I * H * 2 / COPY_TBPS / 1e6, results)


# the down kernel's own (BN, BK, warps, stages) candidates: wider output tiles re-read the activations less
DOWN_CFGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3), (64, 128, 4, 3),
             (128, 64, 4, 4), (64, 64, 4, 5)]


def tune_grouped(dev, dt, results):
    """The grouped path (alignment + both GEMMs, summed by the caller) at decode-batch and verify sizes: 32 tokens
    (a k = 3 verify at batch 8), 64 (plain batch 64) and 256 (verify at batch 64, plain batch 256); at 32 tokens
    also the pair kernels pushed past their limit."""
    w13, w2 = expert_weights(dev, dt)
    cfgs = [(bm, bn, bk, 4, 3) for bm in (16, 32, 64) for bn, bk in ((32, 128), (64, 64), (64, 128), (128, 64))]
    # deeper pipelines and more warps: the 2816-pair case (verify at batch 64) sat at 2.5x its bytes with all
    # of the above
    cfgs += [(64, 64, 64, 4, 4), (64, 64, 64, 4, 5), (64, 64, 64, 8, 3), (64, 128, 64, 8, 4), (32, 64, 128, 4, 4),
             (64, 32, 128, 4, 4)]
    for tokens in (32, 64, 256):
        P = tokens * (TOP_K + 1)
        ids = [routed_ids(tokens, dev) for _ in range(LAYERS)]
        uniq = sum(int(i.unique().numel()) for i in ids) / LAYERS
        floor = uniq * 3 * I * H * 2 / COPY_TBPS / 1e6
        x = torch.randn(tokens, H, device=dev, dtype=dt)
        tw = torch.rand(tokens, TOP_K + 1, device=dev, dtype=dt)

        def whole(cfg, pair_limit=0):
            def fn():
                saved = M.PAIR_GEMV_MAX_PAIRS, M.GROUPED_CFG
                M.PAIR_GEMV_MAX_PAIRS, M.GROUPED_CFG = pair_limit, ((1 << 62, cfg),)
                try:
                    for layer in range(LAYERS):
                        M.fused_moe(x, w13[layer], w2[layer], tw, ids[layer], reduce=False)
                finally:
                    M.PAIR_GEMV_MAX_PAIRS, M.GROUPED_CFG = saved
            return fn
        sweep(f"grouped_cfg_t{tokens}", cfgs, whole, floor, results)
        up = tuple(results[f"grouped_cfg_t{tokens}"]["rows"][0]["cfg"])
        if tokens >= 64:  # the down kernel (K = 512, N = 2048) with its own tiles, gate/up's best kept
            sweep(f"grouped_down_t{tokens}", [up + d for d in DOWN_CFGS], whole, floor, results)
            up = tuple(results[f"grouped_down_t{tokens}"]["rows"][0]["cfg"])
        kernel_split(f"grouped_cfg_t{tokens}", whole(up), results)
        if tokens >= 64:  # torch._grouped_mm (CUTLASS), the prefill path, at this size
            def cutlass(cfg):
                def fn():
                    saved = G.GROUPED_MM_MIN_PAIRS
                    G.GROUPED_MM_MIN_PAIRS = 0
                    try:
                        for layer in range(LAYERS):
                            M.fused_moe(x, w13[layer], w2[layer], tw, ids[layer], reduce=False)
                    finally:
                        G.GROUPED_MM_MIN_PAIRS = saved
                return fn
            sweep(f"grouped_mm_t{tokens}", [("cutlass",)], cutlass, floor, results)
            kernel_split(f"grouped_mm_t{tokens}", cutlass(None), results)
        if tokens == 32:
            sweep("pair_path_t32", [M.GROUPED_CFG[0][1]], lambda cfg: whole(cfg, pair_limit=P), floor, results)


def tune_gather(dev, dt, results):
    """The prefill MoE's pair rows in expert order at an 8192-token bench-6b chunk (90112 rows of 2048, shared
    expert included), as the prefill sorts them (random experts per token): torch's ``index_select`` (cfg 0),
    the Triton gather by sorted row (1, ``HYLO_SCATTER_ROWS=0``) and the scatter by pair (2, the default; then
    tokens per program and warps, ``HYLO_SCATTER_ROWS_CFG``), against the bytes written and read once. The
    sweep of session 14 gathered rows whose tokens were in ascending order, which kept every token's row in L2."""
    tokens, k = 8192, TOP_K + 1
    x = torch.randn(tokens, H, device=dev, dtype=dt)
    pos, tok, _ = G.sort_pairs_by_expert(routed_ids(tokens, dev).view(-1), E + 1, k)
    floor = (tokens * k + tokens) * H * 2 / COPY_TBPS / 1e6
    modes = {0: "torch", 1: "gather", 2: "scatter"}

    def run(cfg):
        def fn():
            for _ in range(LAYERS):
                if cfg[0] == 2:
                    G.scatter_rows(x, pos, k, cfg=cfg[1:])
                else:
                    G.sorted_rows(x, pos, tok, k, modes[cfg[0]])
        return fn
    cfgs = [(0,), (1,)] + [(2, bt, w) for bt in (1, 2, 4) for w in (4, 8, 16)]
    sweep("sorted_rows_t8192", cfgs, run, floor, results)


def tune_prefill_moe(dev, dt, results, tokens=8192, layers=4):
    """The grouped gate/up and down GEMMs of one MoE layer at ``tokens`` tokens; cfg = (BM, BN, BK, warps, stages).
    Floor: 2 x pairs x 3 x I x H FLOPs of the expert matmuls at the measured bf16 matmul rate."""
    tflops = measure_matmul_rate(dev) / 1e12
    P = tokens * (TOP_K + 1)
    w13, w2 = expert_weights(dev, dt, layers)
    ids = routed_ids(tokens, dev).view(-1)
    wts = torch.rand(P, device=dev, dtype=dt)
    x = torch.randn(tokens, H, device=dev, dtype=dt)
    act = torch.randn(P, I, device=dev, dtype=dt)
    out = torch.empty(P, H, device=dev, dtype=dt)
    floor13 = 2 * P * 2 * I * H / tflops / 1e9
    floor2 = 2 * P * I * H / tflops / 1e9
    aligned = {}

    def align(bm):
        if bm not in aligned:
            aligned[bm] = M.align_pairs(ids, E + 1, bm)
        return aligned[bm]

    def run(kind, cfg):
        bm, bn, bk, warps, stages = cfg
        sp, be = align(bm)

        def fn():
            for layer in range(layers):
                if kind == "gate_up":
                    M._grouped_gate_up_kernel[(be.shape[0], triton.cdiv(I, bn))](
                        x, w13[layer], sp, be, act, H, I, P, TOP_K=TOP_K + 1, BM=bm, BN=bn, BK=bk, PREC="tf32",
                        num_warps=warps, num_stages=stages)
                else:
                    M._grouped_down_kernel[(be.shape[0], triton.cdiv(H, bn))](
                        act, w2[layer], sp, be, wts, out, H, I, P, BM=bm, BN=bn, BK=bk, PREC="tf32",
                        num_warps=warps, num_stages=stages)
        return fn

    cfgs = list(itertools.product((64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4)))
    for kind, floor in (("gate_up", floor13), ("down", floor2)):
        rows = []
        for cfg in cfgs:
            try:
                ms = time_eager(run(kind, cfg)) / layers
            except Exception as exc:  # registers / shared memory
                print(f"  prefill {kind} {cfg}: failed ({type(exc).__name__})")
                continue
            rows.append((ms, cfg))
        rows.sort()
        name = f"prefill_grouped_{kind}_t{tokens}"
        results[name] = {"floor_ms": floor, "tflops": tflops, "rows": [{"ms": ms, "cfg": list(c)} for ms, c in rows]}
        print(f"{name}: floor {floor:.3f} ms; best {rows[0][0]:.3f} ms ({rows[0][0] / floor:.2f}x) {rows[0][1]}; "
              f"current (64, 64, 64, 4, 3): {next((m for m, c in rows if c == (64, 64, 64, 4, 3)), float('nan')):.3f}",
              flush=True)
        for ms, cfg in rows[:5]:
            print(f"    {ms:7.3f} ms  {cfg}")
    # the same MoE layer through torch._grouped_mm (what the engine runs for large prefill chunks on Hopper)
    from hylo.ops.moe_grouped_mm import fused_moe_grouped_mm

    wts2, ids2 = wts.view(tokens, TOP_K + 1), ids.view(tokens, TOP_K + 1)

    def grouped_mm():
        for layer in range(layers):
            fused_moe_grouped_mm(x, w13[layer], w2[layer], wts2, ids2)
    ms = time_eager(grouped_mm) / layers
    results[f"prefill_grouped_mm_t{tokens}"] = {"floor_ms": floor13 + floor2, "ms": ms}
    print(f"prefill torch._grouped_mm MoE layer (sort, gather, both GEMMs, scatter): {ms:.3f} ms; floor "
          f"{floor13 + floor2:.3f} ms ({ms / (floor13 + floor2):.2f}x)", flush=True)


if __name__ == "__main__":
    main()
