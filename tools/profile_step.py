"""Where a decode / verify step's GPU time goes: eager steps of bench-6b under the torch profiler, kernel time
summed by kernel name. With --prefill N, the same for one N-token prefill step instead.
Usage: python tools/profile_step.py [--bs 1 64] [--prefill 8192] [--graphs] [--launches] [--out DIR]"""

import argparse
import collections
import cProfile
import io
import pstats
import json
import os
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from hylo.bench.run import build_model
from hylo.bench.shapes import bench_config
from hylo.bench.steps import clear, fake_prefill, graph_alone_ms, overlap_profile, time_steps
from hylo.config import EngineConfig
from hylo.sampling_params import SamplingParams
from hylo.engine.engine import Engine
from hylo.models.registry import has_mtp_head
from hylo.speculative.setup import SpecSetup


def main():
    from gpu_only import require

    require("tools/profile_step.py", modules=())
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    ap.add_argument("--out", default=".")
    ap.add_argument("--model-name", default="bench-6b", help="benchmark shape (hylo bench's names, -fp8 ones too)")
    ap.add_argument("--launches", action="store_true",
                    help="also write every kernel launch of one step at the first --bs in order: name, grid, time, gap")
    ap.add_argument("--graphs", action="store_true", help="profile CUDA-graph replays (as the bench runs) instead "
                    "of eager steps")
    ap.add_argument("--host", action="store_true", help="profile the host side of overlapped, graph-replayed "
                    "decode steps (cProfile), beside their wall and GPU-only times")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lm = build_model(bench_config(args.model_name), torch.device("cuda"), name=args.model_name)
    report = {}
    if args.host:
        profile_host(lm, args.bs, report)
        with open(os.path.join(args.out, "profile_host.json"), "w") as f:
            json.dump(report, f, indent=1)
        return
    if args.prefill:
        profile_prefill(lm, args.prefill, report, args.out)
        with open(os.path.join(args.out, f"profile_prefill_{args.prefill}.json"), "w") as f:
            json.dump(report, f, indent=1)
        return
    method = "mtp" if has_mtp_head(lm.config) else "ngram"
    for spec in (False, True):
        kw = (dict(speculative=method, num_speculative_tokens=3, simulate_accept_length=3.0, spec_policy="fixed")
              if spec else {})
        ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=max(args.bs), kv_cache_tokens=max(args.bs) * 1200, cuda_graphs=args.graphs,
                          max_model_len=1100, verbose=False, **kw)
        eng = Engine(lm, device="cuda", dtype="bfloat16", engine_config=ec,
                     spec_setup=SpecSetup(method) if spec else None)
        for bs in args.bs:
            rids = fake_prefill(eng, bs, 1024)
            for _ in range(3):
                eng.step()
            torch.cuda.synchronize()
            steps = 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    eng.step()
                torch.cuda.synchronize()
            summarize(prof, steps, f"{'spec' if spec else 'decode'}_bs{bs}", report)
            if args.launches and bs == args.bs[0]:  # the first batch size only (the device returns 8 files)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    eng.step()
                    torch.cuda.synchronize()
                launches(prof, os.path.join(args.out, f"launches_{'spec' if spec else 'decode'}_bs{bs}.json"))
            clear(eng, rids)
        del eng
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
        json.dump(report, f, indent=1)


def profile_host(lm, batch_sizes: list[int], report: dict, steps: int = 30) -> None:
    """Plain decode at each batch size as the bench runs it (graphs, overlap): the wall per step unprofiled, the
    decode graph's GPU time alone, the busy fraction under the torch profiler, then the host's functions under
    cProfile. When the wall exceeds the GPU time, the cProfile table says which host work is in the way."""
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=max(batch_sizes), kv_cache_tokens=max(batch_sizes) * 1200, cuda_graphs=True,
                      cuda_graph_sizes=tuple(batch_sizes), max_model_len=1300, verbose=False)
    eng = Engine(lm, device="cuda", dtype="bfloat16", engine_config=ec)
    for bs in batch_sizes:
        rids = fake_prefill(eng, bs, 1024)
        wall = time_steps(eng, steps)
        gpu = graph_alone_ms(eng, "decode", iters=steps)
        clear(eng, rids)
        rids = fake_prefill(eng, bs, 1024)
        busy = overlap_profile(eng, steps)
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
        profiled, top = host_table(lambda: [eng.step() for _ in range(steps)])
        profiled /= steps
        clear(eng, rids)
        report[f"host_bs{bs}"] = dict(wall_ms_per_step=wall, graph_ms_per_step=gpu, profiled_gpu_busy=busy,
                                      cprofile_ms_per_step=profiled, cprofile_top=top)
        print(f"== host bs{bs}: wall {wall:.2f} ms/step, decode graph alone {gpu or float('nan'):.2f} ms, busy under "
              f"the torch profiler {busy['gpu_busy_fraction']:.3f}, {profiled:.2f} ms/step under cProfile", flush=True)
        print("\n".join(top.splitlines()[:40]), flush=True)


def host_table(fn, rows: int = 25) -> tuple[float, str]:
    """Run ``fn`` under cProfile, then wait for the GPU: (wall ms, the functions with the most own time)."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    ms = (time.perf_counter() - t0) * 1e3
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
    return ms, text.getvalue()


def summarize(prof, steps: int, name: str, report: dict) -> None:
    rows = []
    for e in prof.key_averages():
        if e.device_time_total > 0:
            rows.append((e.key, e.device_time_total / steps / 1e3, e.count / steps))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    report[name] = {"total_gpu_ms": total, "kernels": rows, "launches": sum(r[2] for r in rows)}
    print(f"== {name}: {total:.2f} ms GPU per step, {sum(r[2] for r in rows):.0f} kernels per step")
    for k, ms, n in rows[:30]:
        print(f"  {ms:8.3f} ms  {n:6.0f}x  {k[:90]}")


def launches(prof, path: str) -> list[dict]:
    """Every kernel (and memcpy / memset) of the profiled step in start order, with its grid, its time and the
    idle time between the end of the previous one and its start: the list that shows which neighbours to fuse."""
    trace = path + ".trace"
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    os.remove(trace)
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    rows, end = [], None
    for e in gpu:
        gap = 0.0 if end is None else max(0.0, e["ts"] - end)
        rows.append({"name": e["name"][:80], "grid": e.get("args", {}).get("grid"), "us": e["dur"], "gap_us": gap})
        end = max(end or 0.0, e["ts"] + e["dur"])
    busy = sum(r["us"] for r in rows)
    wall = (end - gpu[0]["ts"]) if gpu else 0.0
    with open(path, "w") as f:
        json.dump({"kernels": len(rows), "busy_us": busy, "span_us": wall, "launches": rows}, f, indent=0)
    print(f"{os.path.basename(path)}: {len(rows)} launches, {busy:.0f} us busy over a {wall:.0f} us span, "
          f"{sum(r['gap_us'] for r in rows):.0f} us of gaps", flush=True)
    return rows


def print_gaps(rows, top: int = 10) -> None:
    """Where the GPU waited inside a step: the largest idle gaps, each with the kernels around it and the time into
    the span at which it began, and the idle time by tenth of the span."""
    t, marks = 0.0, []
    for r in rows:
        marks.append(t)  # time into the span at which this launch's gap begins
        t += r["gap_us"] + r["us"]
    tenths = [0.0] * 10
    for mark, r in zip(marks, rows):
        tenths[min(9, int(10 * mark / max(t, 1e-9)))] += r["gap_us"]
    print("idle us by tenth of the span: " + " ".join(f"{v:.0f}" for v in tenths), flush=True)
    for i in sorted(range(1, len(rows)), key=lambda i: -rows[i]["gap_us"])[:top]:
        print(f"  gap {rows[i]['gap_us']:7.1f} us at {marks[i] / 1e3:6.2f} ms: {rows[i - 1]['name'][:45]} -> "
              f"{rows[i]['name'][:45]}", flush=True)


def layer_timeline(eng, prompt) -> list[dict]:
    """One prefill step without the profiler (which slows the host it is meant to watch): for every decoder layer,
    when the host had launched it and when the GPU finished it, both from the step's start (a CUDA event after
    each layer, read once the step is done). Where the GPU finishes a layer right after the host launched it, the
    GPU was waiting for the host there; the GPU's lead shrinking from layer to layer means the same."""
    marks = []

    def after(module, args, output):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((time.perf_counter(), ev))

    worker = eng.model_worker
    layers = worker.model.layers
    hooks = [layer.register_forward_hook(after) for layer in layers]
    # the host's start of the step: when each stage before the first layer's launches had returned
    stages, patched = {}, []

    def timed(obj, name):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            out = fn(*a, **k)
            stages.setdefault(name, time.perf_counter())
            return out
        setattr(obj, name, wrapper)
        patched.append((obj, name))

    timed(eng.scheduler, "schedule")
    timed(worker, "build_batch")
    timed(worker.backend, "init_forward_metadata")

    def embedded(module, args):  # returns None: a pre-hook's return value would replace the layer's arguments
        stages.setdefault("embedding", time.perf_counter())

    hooks.append(layers[0].register_forward_pre_hook(embedded))
    try:
        rid = eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        eng.step()
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
        clear(eng, [rid])
    finally:
        for h in hooks:
            h.remove()
        for obj, name in patched:
            delattr(obj, name)
    rows, prev_gpu = [], 0.0
    for i, (t, ev) in enumerate(marks):
        gpu = start.elapsed_time(ev)
        rows.append({"layer": i, "host_ms": (t - t0) * 1e3, "gpu_done_ms": gpu, "gpu_layer_ms": gpu - prev_gpu})
        prev_gpu = gpu
    print(f"prefill layer timeline: step() returned after {host_ms:.1f} ms, GPU done at {wall_ms:.1f} ms "
          f"(layer: host launched / GPU finished / GPU finished minus host launched, ms)", flush=True)
    print("  " + "  ".join(f"{r['layer']}: {r['host_ms']:.1f}/{r['gpu_done_ms']:.1f}/"
                           f"{r['gpu_done_ms'] - r['host_ms']:+.1f}" for r in rows), flush=True)
    print("  host start (ms after step() began, when each had returned): " + ", ".join(
        f"{name} {(t - t0) * 1e3:.2f}" for name, t in sorted(stages.items(), key=lambda kv: kv[1])), flush=True)
    rows.append({"host_start_ms": {name: (t - t0) * 1e3 for name, t in stages.items()}})
    return rows


def profile_prefill(lm, tokens: int, report: dict, out: str) -> None:
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=4, kv_cache_tokens=tokens + 4096, chunk_size=tokens, cuda_graphs=False,
                      max_model_len=tokens + 64, verbose=False)
    eng = Engine(lm, device="cuda", dtype="bfloat16", engine_config=ec)
    prompt = torch.randint(0, lm.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()

    def one_prefill():
        rid = eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        eng.step()
        torch.cuda.synchronize()
        clear(eng, [rid])

    one_prefill()  # compile / autotune
    for _ in range(2):  # the host's speed varies from run to run: two timelines
        report[f"prefill_{tokens}_layers"] = layer_timeline(eng, prompt)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_prefill()
    summarize(prof, 1, f"prefill_{tokens}", report)
    print_gaps(launches(prof, os.path.join(out, f"launches_prefill_{tokens}.json")))
    # where the host waits: the wall time of step() against the time the GPU is done, and every synchronising
    # CUDA call inside the step, counted by the innermost hylo / fla frame that made it
    rid = eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/hylo/" in f.filename or "/fla/" in f.filename]
        site = (f"{'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno} {frames[-1].name}" if frames
                else f"{filename}:{lineno}")
        sites[site] += 1

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    done_ms = (time.perf_counter() - t0) * 1e3
    clear(eng, [rid])
    report[f"prefill_{tokens}"].update(step_host_ms=host_ms, step_done_ms=done_ms, sync_sites=dict(sites))
    print(f"prefill {tokens}: step() returned after {host_ms:.1f} ms, GPU done at {done_ms:.1f} ms; "
          f"{sum(sites.values())} synchronising calls:", flush=True)
    for site, n in sites.most_common():
        print(f"  {n:4d}  {site}", flush=True)
    # the host's own time in a prefill step: when step() returns after the GPU would have finished, the host's
    # launches (and the Python around them) set the pace, and this table says which
    rid = eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    ms, top = host_table(eng.step, rows=30)
    clear(eng, [rid])
    report[f"prefill_{tokens}"].update(cprofile_ms=ms, cprofile_top=top)
    print(f"prefill {tokens} under cProfile: {ms:.1f} ms\n" + "\n".join(top.splitlines()[:45]), flush=True)


if __name__ == "__main__":
    main()
