"""What the kernel sweeps share: CUDA-graph and eager timing, a sweep over launch configurations, the per-kernel
split of a timed call, and bench-6b's shapes."""

import torch

from hylo.bench.floors import _time_cuda

LAYERS, H, I, E, TOP_K = 24, 2048, 512, 64, 10
COPY_TBPS = 4.28


def time_graph(fn, reps=20, layers=LAYERS) -> float:
    """Microseconds per call of ``fn`` (which makes ``layers`` calls), from CUDA-graph replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / layers


def sweep(name, configs, make_fn, floor_us, results, layers=LAYERS):
    """Time every configuration (``make_fn(cfg)`` makes ``layers`` calls); the rows go to ``results[name]``, best first."""
    rows = []
    for cfg in configs:
        try:
            us = time_graph(make_fn(cfg), layers=layers)
        except Exception as exc:  # a config that does not compile (registers, shared memory)
            print(f"  {name} {cfg}: failed ({type(exc).__name__})")
            continue
        rows.append((us, cfg))
    rows.sort()
    results[name] = {"floor_us": floor_us, "rows": [{"us": us, "cfg": list(cfg)} for us, cfg in rows]}
    best = rows[0]
    print(f"{name}: floor {floor_us:.1f} us; best {best[0]:.1f} us ({best[0] / floor_us:.2f}x) {best[1]}; "
          f"worst {rows[-1][0]:.1f}", flush=True)
    for us, cfg in rows[:4]:
        print(f"    {us:7.1f} us  {cfg}")


def kernel_split(name, fn, results, layers=LAYERS):
    """Microseconds per layer of each kernel that ``fn`` (``layers`` calls) launches, from the torch profiler: which
    part of a whole-layer time to work on."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    split = {e.key[:60]: e.device_time_total / layers for e in prof.key_averages() if e.device_time_total > 0}
    results[name]["kernels_us"] = split
    print("    per kernel: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(split.items(), key=lambda kv: -kv[1])))


def time_eager(fn, reps=3) -> float:
    """Milliseconds per call of ``fn`` after one warm-up call (no graph: the kernels are long)."""
    fn()
    return _time_cuda(fn, reps)


def overall_winner(sweeps) -> tuple | None:
    """The configuration with the least sum, over the given sweeps (all of them present), of its time over that
    sweep's best time; None when a sweep is missing."""
    if not sweeps or any(s is None for s in sweeps):
        return None
    score = {}
    for s in sweeps:
        best = s["rows"][0]["us"]
        for row in s["rows"]:
            score.setdefault(tuple(row["cfg"]), []).append(row["us"] / best)
    complete = {cfg: sum(v) for cfg, v in score.items() if len(v) == len(sweeps)}
    return min(complete, key=complete.get) if complete else None


def routed_ids(tokens, dev, experts=E, top_k=TOP_K) -> torch.Tensor:
    """[tokens, top_k + 1]: top_k distinct random experts of ``experts`` per token, then the shared expert (id
    ``experts``); bench-6b's by default."""
    return torch.cat([torch.stack([torch.randperm(experts, device=dev)[:top_k] for _ in range(tokens)]),
                      torch.full((tokens, 1), experts, device=dev)], 1).contiguous()
