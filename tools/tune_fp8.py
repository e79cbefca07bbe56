"""The grouped MoE kernels' tiles on block-FP8 experts (``moe_triton.GROUPED_FP8_CFG``), at the sizes where FP8
experts reach them: a decode batch of 64 and the verify of k = 3 drafts at batch 64 (256 tokens), on the released
MoE shapes, where a 256-token verify leaves only a few pairs per expert (Qwen3.5-35B-A3B: 256 experts, 8 routed and a
shared one, about 9 pairs an expert; Qwen3-Next-80B-A3B: 512 experts, 10 routed, about 5). bfloat16 experts leave
these sizes to ``torch._grouped_mm``; FP8 ones stay in the Triton kernels, whose table was tuned on bfloat16 tiles.

Then the W8A16 matmul's one tile (``fp8_triton.FP8_MATMUL_CFG``, never swept before) at 64 and 256 rows on the
GDN projections' shapes. Each grouped configuration times the whole grouped path (alignment, gate/up, down) over
LAYERS independent weight sets in a CUDA graph, against the bytes of the experts the pairs touch read once at the
copy rate. Usage (from the checkout):
python tools/tune_fp8.py [--shape 35b|80b ...] [--tokens 256 64] [--out DIR] [--env FILE]
writes tune_fp8.json, and with --env the winners as HYLO_GROUPED_FP8_CFG / _SWAP and HYLO_FP8_MATMUL_CFG for a
benchmark run right after.
"""

import argparse
import json
import os

from gpu_only import require

if __name__ == "__main__":  # one line, not a traceback, where there is no CUDA GPU or no Triton (tests import it)
    require("tools/tune_fp8.py")

import torch  # noqa: E402

from hylo.ops import moe_triton as M  # noqa: E402
from hylo.ops.fp8 import Fp8Weight, quantize_fp8_block  # noqa: E402
from tune_common import COPY_TBPS, kernel_split, overall_winner, routed_ids, sweep  # noqa: E402

H, I, BLOCK = 2048, 512, (128, 128)
SHAPES = {"35b": (256, 8), "80b": (512, 10)}  # (routed experts, routed per token); plus one shared expert
LAYERS = 8  # 8 x 257 experts of 3 MB: far past L2, as in the model
# (BM, BN, BK, warps, stages): BK is an FP8 tile's whole scale block or half of it; few rows per expert favour small
# BM (one block per expert, no padding rows to multiply); the first two rows are the bfloat16 table's
UP_CFGS = [(16, 64, 128, 4, 3), (64, 64, 64, 4, 3), (16, 32, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3),
           (16, 128, 128, 8, 3), (32, 64, 128, 4, 3), (32, 128, 128, 8, 3), (16, 256, 128, 8, 3), (16, 64, 64, 4, 4),
           (64, 128, 128, 8, 3), (32, 32, 128, 4, 3)]
# the down kernel's own (BN, BK, warps, stages), gate/up's best kept (N = H = 2048, K = I = 512)
DOWN_CFGS = [(64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (256, 128, 8, 3), (32, 128, 4, 3), (128, 64, 4, 3)]


def fp8_experts(experts: int, dev, layers: int = LAYERS):
    """``layers`` sets of routed plus shared experts as FP8 weights with random block scales: (w13s, w2s)."""
    def one(n, k):
        q, s = quantize_fp8_block(torch.randn(experts + 1, n, k, device=dev, dtype=torch.bfloat16) * 0.02, BLOCK)
        return Fp8Weight(q, s, BLOCK)
    return [one(2 * I, H) for _ in range(layers)], [one(H, I) for _ in range(layers)]


def tune_grouped_fp8(dev, shape: str, results, tokens_list=(64, 256)):
    """Per token count: the gate/up tiles, then the down kernel's own, each with the dot's operands as they are
    and swapped (``GROUPED_FP8_SWAP``); then the pair kernels pushed to that size, for comparison."""
    experts, top_k = SHAPES[shape]
    w13, w2 = fp8_experts(experts, dev)
    for tokens in tokens_list:
        ids = [routed_ids(tokens, dev, experts, top_k) for _ in range(LAYERS)]
        uniq = sum(int(i.unique().numel()) for i in ids) / LAYERS
        floor = uniq * 3 * I * H / COPY_TBPS / 1e6  # a byte a weight (the scales are 1/16384 of that)
        x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
        tw = torch.rand(tokens, top_k + 1, device=dev, dtype=torch.bfloat16)

        def whole(cfg, swap=False, pair_limit=0):
            def fn():
                saved = M.PAIR_GEMV_MAX_PAIRS, M.GROUPED_FP8_CFG, M.GROUPED_FP8_SWAP
                M.PAIR_GEMV_MAX_PAIRS, M.GROUPED_FP8_CFG, M.GROUPED_FP8_SWAP = pair_limit, ((1 << 62, cfg),), swap
                try:
                    for layer in range(LAYERS):
                        M.fused_moe(x, w13[layer], w2[layer], tw, ids[layer], reduce=False)
                finally:
                    M.PAIR_GEMV_MAX_PAIRS, M.GROUPED_FP8_CFG, M.GROUPED_FP8_SWAP = saved
            return fn
        for swap in (False, True):
            name = f"grouped_fp8_{shape}_t{tokens}" + ("_swap" if swap else "")
            try:
                sweep(name, UP_CFGS, lambda cfg: whole(cfg, swap), floor, results, layers=LAYERS)
            except IndexError:  # every configuration failed to compile
                print(f"{name}: no configuration ran")
                results.pop(name, None)
                continue
            up = tuple(results[name]["rows"][0]["cfg"])
            sweep(name + "_down", [up + d for d in DOWN_CFGS], lambda cfg: whole(cfg, swap), floor, results,
                  layers=LAYERS)
            down = results[name + "_down"]["rows"][0]
            best = tuple(down["cfg"]) if down["us"] < results[name]["rows"][0]["us"] else up
            results[name]["best"] = list(best)
            results[name]["best_us"] = min(down["us"], results[name]["rows"][0]["us"])
            kernel_split(name, whole(best, swap), results, layers=LAYERS)
        # the pair kernels (one GEMV per pair, decode's path) pushed to this size, for comparison
        sweep(f"grouped_fp8_{shape}_t{tokens}_pairs", [("pairs",)],
              lambda cfg: whole(UP_CFGS[0], pair_limit=tokens * (top_k + 1)), floor, results, layers=LAYERS)
    del w13, w2
    torch.cuda.empty_cache()


# the W8A16 matmul (``fp8_triton.FP8_MATMUL_CFG``, one tile for 17 to 511 rows: decode batches past the GEMV and
# verifies): (BM, BN, BK, warps, stages), the first row the committed default (never swept before)
MATMUL_CFGS = [(64, 128, 128, 8, 3), (16, 128, 128, 4, 3), (32, 128, 128, 4, 3), (32, 64, 128, 4, 4),
               (64, 64, 128, 4, 3), (64, 128, 128, 4, 4), (64, 256, 128, 8, 3), (128, 128, 128, 8, 3),
               (32, 256, 128, 8, 3), (16, 64, 128, 4, 4)]
# the GDN input projection and the output projection of the 35B / 80B shapes (N, K)
MATMUL_SHAPES = ((12288, 2048), (2048, 4096))


def tune_matmul(dev, results, rows_list=(64, 256)):
    from hylo.ops import fp8_triton as F8

    ws = {nk: [Fp8Weight(*quantize_fp8_block(torch.randn(*nk, device=dev, dtype=torch.bfloat16) * .02, BLOCK),
                         BLOCK) for _ in range(LAYERS)] for nk in MATMUL_SHAPES}
    for rows in rows_list:
        x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)

        def run(cfg):
            def fn():
                saved = F8.FP8_MATMUL_CFG
                F8.FP8_MATMUL_CFG = cfg
                try:
                    for layer in range(LAYERS):
                        for (n, k), w in ws.items():
                            F8.fp8_matmul(x[:, :k], w[layer])
                finally:
                    F8.FP8_MATMUL_CFG = saved
            return fn
        floor = sum(n * k for n, k in MATMUL_SHAPES) / COPY_TBPS / 1e6
        sweep(f"fp8_matmul_t{rows}", MATMUL_CFGS, run, floor, results, layers=LAYERS)


def fp8_env(results, shape: str) -> list[str]:
    """HYLO_GROUPED_FP8_CFG (the 64-token winner up to 1024 pairs, the 256-token one up to 4096, the committed
    table's last tile past that: prefill's, which the sizes swept say nothing of) and, where the swapped
    dot's winners take less time over the sizes swept both ways, HYLO_GROUPED_FP8_SWAP=1 with their table; the
    W8A16 matmul's tile (HYLO_FP8_MATMUL_CFG) that does best over 64 and 256 rows together."""
    runs = {swap: [results.get(f"grouped_fp8_{shape}_t{t}{swap}") for t in (64, 256)] for swap in ("", "_swap")}
    lines = []
    if runs[""][1]:  # (without the 64-token sweep, the committed tile up to 1024 pairs, unswapped)
        paired = [(plain, swapped) for plain, swapped in zip(runs[""], runs["_swap"]) if plain and swapped]
        swap = bool(paired) and sum(b["best_us"] - a["best_us"] for a, b in paired) < 0
        small, large = runs["_swap" if swap else ""]
        cfg = lambda r: ",".join(map(str, r["best"] if r else M.GROUPED_FP8_CFG[0][1]))  # noqa: E731
        prefill = ",".join(map(str, M.GROUPED_FP8_CFG[-1][1]))
        lines += [f"export HYLO_GROUPED_FP8_CFG='1024:{cfg(small)};4096:{cfg(large)};max:{prefill}'",
                  f"export HYLO_GROUPED_FP8_SWAP={int(swap)}"]
    matmul = overall_winner([results.get(f"fp8_matmul_t{t}") for t in (64, 256)])
    if matmul:  # the tile with the least sum of time over each size's best
        lines.append("export HYLO_FP8_MATMUL_CFG=" + ",".join(map(str, matmul)))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=["35b"], choices=sorted(SHAPES))
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256], choices=[64, 256])
    ap.add_argument("--env", default=None, help="write the first shape's winners as a shell export to this file")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = {}

    def save():  # after every section: a run cut by its time limit keeps what it measured
        with open(os.path.join(args.out, "tune_fp8.json"), "w") as f:
            json.dump(results, f, indent=1)
        lines = fp8_env(results, args.shape[0])
        if args.env and lines:
            with open(args.env, "w") as f:
                f.write("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    for i, shape in enumerate(args.shape):
        tune_grouped_fp8(torch.device("cuda"), shape, results, tuple(sorted(args.tokens, reverse=True)))
        save()
        if i == 0:
            tune_matmul(torch.device("cuda"), results)
            save()


if __name__ == "__main__":
    main()
