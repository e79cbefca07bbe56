"""A/B of the captured plain decode step on bench-6b (or ``--model-name``'s shape) under settings read from the environment at start-up.

    python tools/ab_decode.py --variant base: --variant tc:HYLO_GEMV_FMA=0 --bs 1 8 --rounds 2 --out DIR

Each variant runs in its own process (the settings are module globals read at import), builds bench-6b with random
weights on the GPU, captures the decode graphs and measures, per batch size at context 1k, the wall time of a
steady-state step (``bench.steps.time_steps``) and the decode graph's GPU time alone. With ``--rounds 2`` the
variants run twice, interleaved (A B A B), and each keeps its better round: the host and the GPU clocks drift a few
percent across a call. The rows go to stdout and to DIR/ab-decode-<time>.json. ``--prefill N`` measures the
prefill of one N-token prompt instead (best of four after a first, compiling one), on a one-request engine sized
for the prompt (the bench's prefill row runs on its larger decode engine: 4 graph sizes, a 40k context), and
writes DIR/ab-prefill-<time>.json. A variant's ``HYLO_ABLATE`` leaves pieces of the step out (``tools/ablate.py``:
what-if timing); ``AB_BENCH_ENGINE=1`` sizes its engine as ``hylo bench`` does; ``AB_MODEL=NAME`` runs that variant
on another shape (``--variant bf16:AB_MODEL=bench-6b --variant fp8:AB_MODEL=bench-6b-fp8``: FP8 against bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time


def child(batches: list[int], model_name: str) -> None:
    import torch

    from hylo.bench.run import SPEC_KV_TOKENS, SPEC_MODEL_LEN, build_model
    from hylo.bench.shapes import bench_config
    from hylo.bench.floors import Footprint, measure_copy_rate
    from hylo.bench.steps import clear, fake_prefill, graph_alone_ms, time_steps
    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ablate

    ablate.apply()  # HYLO_ABLATE: pieces left out (what-if timing)
    dev = torch.device("cuda")
    copy_rate = measure_copy_rate(dev)
    lm = build_model(bench_config(model_name), dev, name=model_name)
    # AB_BENCH_ENGINE=1: the engine as `hylo bench` sizes it (256 sequences, a 40k context, a 2.2M-token KV pool)
    big = os.environ.get("AB_BENCH_ENGINE") == "1"
    seqs = 256 if big else max(batches)
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=seqs, kv_cache_tokens=64 * 32768 + 300 * 256 if big else seqs * SPEC_KV_TOKENS,
                      chunk_size=8192, cuda_graph_sizes=tuple(batches), max_model_len=40000 if big else SPEC_MODEL_LEN,
                      verbose=False)
    eng = Engine(lm, device="cuda", dtype="bfloat16", engine_config=ec)
    fp = Footprint.of(lm.model, None, eng.caches)
    rows = []
    for bs in batches:
        rids = fake_prefill(eng, bs, 1024)
        wall = time_steps(eng, 30)
        gpu = graph_alone_ms(eng, "decode", 50)
        floor = fp.decode_bytes(bs, 1024) / copy_rate * 1e3
        rows.append(dict(batch_size=bs, ms_per_step=wall, graph_ms=gpu, floor_ms=floor))
        clear(eng, rids)
    print("AB_ROWS " + json.dumps(rows), flush=True)


def child_prefill(tokens: int, model_name: str) -> None:
    import torch

    from hylo.bench.run import build_model
    from hylo.bench.shapes import bench_config
    from hylo.bench.steps import prefill_times
    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine

    mc = bench_config(model_name)
    lm = build_model(mc, torch.device("cuda"), name=model_name)
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=1, kv_cache_tokens=tokens + 4096, chunk_size=tokens, cuda_graph_sizes=(1,),
                      max_model_len=tokens + 256, verbose=False)
    eng = Engine(lm, device="cuda", dtype="bfloat16", engine_config=ec)
    prompt = torch.randint(0, mc.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    times = prefill_times(eng, prompt, 5)
    print("AB_ROWS " + json.dumps([dict(tokens=tokens, ms_per_step=min(times[1:]), graph_ms=min(times[1:]),
                                        times_ms=times)]), flush=True)


def main() -> None:
    from gpu_only import require

    require("tools/ab_decode.py", modules=())
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:VAR=VALUE,VAR=VALUE (environment of that variant; 'base:' for none)")
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=0, help="time the prefill of one prompt of this many tokens")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--model-name", default="bench-6b", help="benchmark shape (hylo bench's names, -fp8 ones too)")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child_prefill(args.prefill, args.model_name) if args.prefill else child(args.bs, args.model_name)
        return
    if not args.variant:
        ap.error("give at least one --variant")
    variants = []
    for spec in args.variant:
        name, _, assigns = spec.partition(":")
        # a comma starts the next assignment only before NAME=, so that a value may hold commas ("4,256,4,1")
        env = dict(kv.split("=", 1) for kv in re.split(r",(?=[A-Za-z_]\w*=)", assigns) if kv)
        variants.append((name, env))
    # a child runs this file as a script (its folder first on sys.path): the repository's root goes on its path,
    # so that hylo imports without being installed (session 18's first A/B on the H200 lost its children to that)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child_path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    best: dict[str, list[dict]] = {}
    every: list[dict] = []
    failed: set[str] = set()
    os.makedirs(args.out, exist_ok=True)
    kind = "prefill" if args.prefill else "decode"
    path = os.path.join(args.out, f"ab-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")

    def save():  # after every variant, so that a call cut short by its time limit keeps what it measured
        with open(path, "w") as f:
            json.dump({"model": args.model_name, "variants": {n: e for n, e in variants}, "best": best, "rounds": every}, f, indent=1)

    for rnd in range(args.rounds):
        for name, env in variants:
            cmd = [sys.executable, __file__, "--child", "--bs", *map(str, args.bs), "--prefill", str(args.prefill),
                   "--model-name", env.get("AB_MODEL", args.model_name)]
            proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": child_path, **env}, capture_output=True,
                                  text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AB_ROWS ")), None)
            if line is None:
                print(f"{name}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
                failed.add(name)
                continue
            rows = json.loads(line[len("AB_ROWS "):])
            every.append({"round": rnd + 1, "variant": name, "rows": rows})
            for r in rows:
                if args.prefill:
                    print(f"round {rnd + 1} {name:>12} prefill {r['tokens']}: {r['ms_per_step']:.2f} ms "
                          f"(each: {', '.join(f'{t:.1f}' for t in r['times_ms'])})", flush=True)
                    continue
                print(f"round {rnd + 1} {name:>12} bs={r['batch_size']:>3}: {r['ms_per_step']:.3f} ms/step "
                      f"({r['ms_per_step'] / r['floor_ms']:.2f}x floor), graph {r['graph_ms']:.3f} ms", flush=True)
            old = best.get(name)
            best[name] = rows if old is None else [min(a, b, key=lambda r: r["graph_ms"]) for a, b in zip(old, rows)]
            save()
    print("best of rounds (by graph time):" if not args.prefill else "best of rounds:")
    for name, rows in best.items():
        if args.prefill:
            print(f"  {name:>12}: prefill {rows[0]['tokens']} {rows[0]['ms_per_step']:.2f} ms")
            continue
        print(f"  {name:>12}: " + ", ".join(f"bs{r['batch_size']} {r['ms_per_step']:.3f} / graph {r['graph_ms']:.3f} "
                                            f"({r['graph_ms'] / r['floor_ms']:.2f}x)" for r in rows))
    if every:
        save()
        print(f"wrote {path}")
    if failed:
        print(f"error: variant{'s' * (len(failed) > 1)} {', '.join(sorted(failed))} failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
