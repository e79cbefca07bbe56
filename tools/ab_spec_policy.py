"""Where the adaptive policy's cost at accept 1.0 goes (issue 38): per generated token at batch 1 (and more), in one
process, interleaved rounds of
- plain: the engine without speculation;
- only-plain: a speculative engine whose steps are all plain (no probes): what a plain step costs with the drafter
  kept current (n-gram history, the MTP head's KV) and the step timer;
- adaptive: the policy itself, from fresh requests (its first verifies, its probes);
- adaptive-late: the same after ``--late`` steps (probes rarer: the steady state of a long generation).

    python tools/ab_spec_policy.py --bs 1 8 --spec mtp ngram --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from hylo.bench.run import build_model  # noqa: E402
from hylo.bench.shapes import bench_config  # noqa: E402
from hylo.bench.spec_policy import _engine, per_token_ms  # noqa: E402
from hylo.bench.steps import clear, fake_prefill  # noqa: E402
from hylo.engine.spec_policy import StepChoice  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-name", default="bench-6b")
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--spec", nargs="+", default=["mtp", "ngram"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--late", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = build_model(bench_config(args.model_name), device, name=args.model_name)
    sizes = tuple(args.bs)
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": []}
    plain_eng = _engine(lm, device, max(args.bs), None, sizes)
    engines = {s: _engine(lm, device, max(args.bs), s, sizes) for s in args.spec}
    for rnd in range(args.rounds):
        for bs in args.bs:
            rids = fake_prefill(plain_eng, bs, 1024)
            plain = per_token_ms(plain_eng, rids, 20, args.steps)[0]
            clear(plain_eng, rids)
            for spec, eng in engines.items():
                eng.worker.simulate_accept_length = 1.0
                policy = eng.scheduler.policy
                row = dict(round=rnd, bs=bs, spec=spec, plain=plain)
                saved = policy.choose
                policy.choose = lambda reqs: StepChoice(False, False)
                rids = fake_prefill(eng, bs, 1024)
                row["only_plain"] = per_token_ms(eng, rids, 20, args.steps)[0]
                clear(eng, rids)
                policy.choose = saved
                rids = fake_prefill(eng, bs, 1024)
                row["adaptive"] = per_token_ms(eng, rids, 40, args.steps)[0]
                row["adaptive_late"] = per_token_ms(eng, rids, args.late, args.steps)[0]
                clear(eng, rids)
                for key in ("only_plain", "adaptive", "adaptive_late"):
                    row[f"{key}_vs_plain"] = row[key] / plain
                res["rows"].append(row)
                print(f"[ab] round {rnd} {spec} bs={bs}: plain {plain:.4f}, only-plain {row['only_plain']:.4f} "
                      f"({row['only_plain_vs_plain']:.3f}x), adaptive {row['adaptive']:.4f} "
                      f"({row['adaptive_vs_plain']:.3f}x), after {args.late} steps {row['adaptive_late']:.4f} "
                      f"({row['adaptive_late_vs_plain']:.3f}x) ms/token", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ab-spec-policy-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"[ab] wrote {path}")


if __name__ == "__main__":
    main()
