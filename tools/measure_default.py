"""Speculative decoding with the trained embedded default on held-out Python files, on the CPU: the mean accept
length of MTP and n-gram drafting (greedy, k = 1..5) and tokens/s with and without speculation, one request at a
time. The held-out files are the ones ``training.json`` lists (those present in this machine's standard library).

    python tools/measure_default.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sysconfig
import time

import torch


def main(argv=None) -> int:
    from hylo import LLM, SamplingParams
    from hylo.models.default import trained_default_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--files", type=int, default=8)
    args = ap.parse_args(argv)
    path = trained_default_path()
    with open(os.path.join(path, "training.json")) as f:
        held = json.load(f)["corpus"]["heldout_paths"]
    root = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(root, p) for p in held if os.path.isfile(os.path.join(root, p))][:args.files]
    plain = LLM(verbose=False)
    tok = plain.tokenizer
    prompts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            ids = tok.encode(fh.read())
        if len(ids) > args.prompt_tokens + 8:
            prompts.append(ids[:args.prompt_tokens])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def run(llm, repeats=3):
        """Outputs and tokens/s, the best of ``repeats`` passes (2 shared cores are noisy)."""
        llm.generate(prompts[0], params, use_tqdm=False)  # warm-up
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
            best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        return outs, best

    ref, base_tps = run(plain)
    records = [dict(method=None, k=0, tokens_per_s=base_tps, accept_length=1.0, speedup=1.0, lossless=True)]
    print(f"plain: {base_tps:.1f} tokens/s over {len(prompts)} held-out files", flush=True)
    for method in ("mtp", "ngram"):
        for k in range(1, 6):
            llm = LLM(verbose=False, speculative=method, num_speculative_tokens=k)
            outs, tps = run(llm)
            steps = sum(o.spec.verify_steps for o in outs)
            emitted = sum(o.spec.verify_steps * o.spec.mean_accept_length for o in outs)
            lossless = all(o.token_ids == r.token_ids for o, r in zip(outs, ref))
            rec = dict(method=method, k=k, tokens_per_s=tps, accept_length=emitted / steps, speedup=tps / base_tps,
                       lossless=lossless)
            records.append(rec)
            print(f"{method} k={k}: accept length {rec['accept_length']:.2f}, {tps:.1f} tokens/s "
                  f"({rec['speedup']:.2f}x), identical to plain: {lossless}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"default-model-cpu-{time.strftime('%Y%m%d-%H%M%S')}.json")
    meta = dict(model=os.path.basename(path), files=[os.path.relpath(f, root) for f in files],
                prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, cpu=platform.processor() or
                platform.machine(), threads=torch.get_num_threads(), torch=torch.__version__)
    with open(out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
