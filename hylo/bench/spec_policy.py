"""``hylo bench --spec-policy``: speculation against plain decoding at simulated accept lengths (issue 38).

For each drafter (MTP, n-gram), batch size and simulated accept length, the time per generated token of three
engines on the same random weights, measured in one run: plain decoding, fixed-k speculation (every step verifies)
and the adaptive policy (engine/spec_policy.py). Then a mixed batch, half of its requests accepting 3.5 tokens per
verify and half 1.0. The steps run through the engine loop as a server runs them (overlap on, graphs), from
context 1k; a measurement is the wall time of ``steps`` steady-state steps over the tokens they emitted, after
``warmup`` steps in which the adaptive policy measures its step costs and settles its estimates.
"""

from __future__ import annotations

import platform
import time

import torch

from ..config import EngineConfig
from .shapes import bench_config, check_cpu_shape
from ..engine.engine import Engine, LoadedModel
from ..speculative.setup import SpecSetup
from .run import build_model, release_gpu_memory, results_file
from .steps import _sync, clear, fake_prefill

ACCEPTS = (1.0, 1.5, 2.0, 3.0, 4.0)
CONTEXT = 1024
MODEL_LEN = 2048


def per_token_ms(eng: Engine, rids: list[str], warmup: int, steps: int) -> tuple[float, float]:
    """(wall ms per generated token, tokens per step) over ``steps`` steps after ``warmup``; the tokens are those
    the host read in that window (the overlap loop reads each step's one step later, the same count of steps)."""
    reqs = [eng.request(r) for r in rids]
    for _ in range(warmup):
        eng.step()
    _sync()
    eng.step()  # the ramp: from here step() returns once the step before was read
    before = sum(len(r.output_ids) for r in reqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs) - before
    return wall * 1e3 / max(tokens, 1), tokens / steps


def _engine(lm: LoadedModel, device: str, bs_max: int, spec: str | None, sizes: tuple[int, ...]) -> Engine:
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=bs_max, kv_cache_tokens=bs_max * (MODEL_LEN + 128),
                      chunk_size=8192, cuda_graph_sizes=sizes, max_model_len=MODEL_LEN, verbose=False,
                      **(dict(speculative=spec, num_speculative_tokens=3, simulate_accept_length=1.0) if spec else {}))
    if device == "cuda":
        release_gpu_memory()
    # the benchmark model is built in bfloat16 (bench.run.build_model), on the CPU too
    return Engine(lm, device=device, dtype="bfloat16", engine_config=ec, spec_setup=SpecSetup(spec) if spec else None)


def _spec_runs(eng: Engine, spec: str, batches, accepts, warmup: int, steps: int, plain: dict, records: list,
               save) -> None:
    policy = eng.scheduler.policy
    for bs in batches:
        for accept in accepts:
            row = dict(spec=spec, batch_size=bs, accept_length=accept, plain_ms_per_token=plain[bs])
            for name in ("fixed", "adaptive"):
                policy.adaptive = name == "adaptive"
                eng.worker.simulate_accept_length = accept
                rids = fake_prefill(eng, bs, CONTEXT)
                ms, per_step = per_token_ms(eng, rids, warmup, steps)
                reqs = [eng.request(r) for r in rids]
                row[f"{name}_ms_per_token"] = ms
                row[f"{name}_tokens_per_step"] = per_step
                row[f"{name}_verify_fraction"] = (sum(r.spec.verify_steps for r in reqs)
                                                  / max(sum(r.spec.verify_steps + r.spec.plain_steps for r in reqs), 1))
                clear(eng, rids)
            best = min(plain[bs], row["fixed_ms_per_token"])
            row["adaptive_vs_plain"] = row["adaptive_ms_per_token"] / plain[bs]
            row["adaptive_vs_best"] = row["adaptive_ms_per_token"] / best
            row["fixed_vs_plain"] = row["fixed_ms_per_token"] / plain[bs]
            records.append(row)
            save()
            print(f"[bench] {spec} bs={bs} accept={accept}: plain {plain[bs]:.3f}, fixed {row['fixed_ms_per_token']:.3f},"
                  f" adaptive {row['adaptive_ms_per_token']:.3f} ms/token (verifies {row['adaptive_verify_fraction']:.2f}"
                  f" of its steps): {row['adaptive_vs_best']:.3f}x the better of plain and fixed", flush=True)
        if bs >= 2:  # half the requests accept 3.5 tokens per verify, half 1.0
            row = dict(spec=spec, batch_size=bs, accept_length="mixed 3.5/1.0", plain_ms_per_token=plain[bs])
            for name in ("fixed", "adaptive"):
                policy.adaptive = name == "adaptive"
                eng.worker.simulate_accept_length = 1.0
                rids = fake_prefill(eng, bs, CONTEXT)
                eng.worker.simulate_rows([eng.request(r).req_slot for r in rids[:bs // 2]], 3.5)
                row[f"{name}_ms_per_token"], row[f"{name}_tokens_per_step"] = per_token_ms(eng, rids, warmup, steps)
                clear(eng, rids)
            eng.worker.simulate_accept_length = 1.0
            row["adaptive_vs_plain"] = row["adaptive_ms_per_token"] / plain[bs]
            row["adaptive_vs_best"] = row["adaptive_ms_per_token"] / min(plain[bs], row["fixed_ms_per_token"])
            records.append(row)
            save()
            print(f"[bench] {spec} bs={bs} mixed 3.5/1.0: plain {plain[bs]:.3f}, fixed {row['fixed_ms_per_token']:.3f}, "
                  f"adaptive {row['adaptive_ms_per_token']:.3f} ms/token", flush=True)
    policy.adaptive = True


def run_spec_policy_bench(model_name: str = "bench-6b", out_dir: str = "bench/results", quick: bool = False,
                          device: str | None = None) -> list[dict]:

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_cpu_shape(model_name, device)
    mc = bench_config(model_name)
    lm = build_model(mc, device, name=model_name)
    big = device == "cuda" and not quick
    batches = (1, 8, 64) if big else (1, 2)
    accepts = ACCEPTS if big else (1.0, 3.0)
    warmup, steps = (40, 60) if big else (6, 6)
    sizes = tuple(batches)
    meta = dict(model=model_name, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                torch=torch.__version__, host=platform.node(), context=CONTEXT, k=3, warmup_steps=warmup,
                timed_steps=steps)
    records: list[dict] = []
    path, save = results_file(out_dir, f"spec-policy-{model_name}", meta, records)

    eng = _engine(lm, device, max(batches), None, sizes)
    plain = {}
    for bs in batches:
        rids = fake_prefill(eng, bs, CONTEXT)
        plain[bs] = per_token_ms(eng, rids, warmup // 2, steps)[0]
        clear(eng, rids)
        print(f"[bench] plain bs={bs}: {plain[bs]:.3f} ms/token", flush=True)
    meta["plain_ms_per_token"] = plain
    del eng
    methods = ("mtp", "ngram") if lm.model.config.num_nextn_predict_layers else ("ngram",)
    for spec in methods:
        eng = _engine(lm, device, max(batches), spec, sizes)
        _spec_runs(eng, spec, batches, accepts, warmup, steps, plain, records, save)
        del eng
    save()
    print(f"[bench] wrote {path}", flush=True)
    return records
