"""Measuring an engine in its steady state, for the benchmark and the profiling tools: requests put straight into
decoding (``fake_prefill``), timed steps, the overlap loop under the profiler, a captured graph's GPU time alone."""

from __future__ import annotations

import math
import time

import torch

from .floors import _time_cuda
from ..core import ReqStatus
from ..sampling_params import SamplingParams
from ..engine.engine import Engine


def fake_prefill(engine: Engine, bs: int, ctx: int, temperature: float = 0.0, constraint=None) -> list[str]:
    """Put ``bs`` requests straight into the decoding state at context ``ctx`` (no prefill is run); they sample
    at ``temperature`` (0: greedy), under ``constraint`` where one is given (their first output token is then
    one the constraint starts with)."""
    sched, caches = engine.scheduler, engine.caches
    gen = torch.Generator().manual_seed(ctx * 7 + bs)
    vocab = engine.model_config.vocab_size
    rids = []
    for _ in range(bs):
        prompt = torch.randint(0, vocab, (ctx - 1,), generator=gen).tolist()
        rid = engine.add_request(prompt, SamplingParams(max_tokens=10 ** 6, temperature=temperature, seed=len(rids),
                                                        ignore_eos=constraint is None, constraint=constraint))
        req = sched.waiting.pop()
        req.req_slot = caches.req_slots.alloc()
        req.state_slot = caches.state_pool.alloc()
        req.status = ReqStatus.RUNNING
        first = int(torch.randint(0, vocab, (1,), generator=gen))
        if req.automaton is not None:
            first = int(req.automaton.allowed(req.automaton.initial)[0])
        req.output_ids = [first]
        req.num_computed = ctx - 1
        n = ctx + sched.kv_lookahead + 64
        locs = caches.kv_pool.alloc(n)
        if locs is None:
            raise RuntimeError(f"KV pool too small for batch {bs} at context {ctx}")
        caches.req_slots.write_locations(torch.stack([torch.full((n,), req.req_slot), torch.arange(n), locs.long()]))
        req.kv_locs, req.num_kv = [locs], n
        req.decoding = True
        engine.model_worker.register_sampling([req])
        engine.model_worker.register_constraints([req])
        caches.req_slots.seq_len[req.req_slot] = req.num_computed
        caches.req_slots.last_token[req.req_slot] = req.output_ids[-1]
        sched.running.append(req)
        rids.append(rid)
    return rids


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(engine: Engine, steps: int, warmup: int = 3, blocks: int = 3) -> float:
    """Wall milliseconds per engine step (scheduling, launch, the step's one device read) in the steady state: the
    best of ``blocks`` back-to-back blocks of ``steps / blocks`` steps each, so that a one-off stall of the host
    (a garbage collection, another process) does not stand for the engine's speed (session 8 saw one batch-64 run
    at 13.4 ms per step between runs of 5.8-6.1 ms, its graph alone timed at 5.9 ms in the same run).

    Each block opens on an idle device (synchronised after the one before). Its first step is the loop's ramp: the
    host schedules and launches it with nothing queued, then returns. In the steady state that follows, ``step()``
    launches step N + 1 and returns once it has read step N's results, so the time between two returns is one
    step of the loop as a server runs it; the block's time is taken from the return of its second step to the
    return of its last. (Up to session 17 a block of 10 steps was timed from before its ramp to a synchronise
    after its last step: each block then counted its ramp's launch latency and its last step's drain, about
    0.03 ms per step at batch 1 on the H200.) Blocks of fewer than 3 steps are timed that way still."""
    for _ in range(warmup):
        engine.step()
    _sync()
    blocks = max(1, min(blocks, steps // 5 or 1))
    per_block = steps // blocks
    steady = per_block >= 3  # a ramp step and one more before the clock starts
    timed = per_block - 2 if steady else per_block
    best = math.inf
    for _ in range(blocks):
        if steady:
            engine.step()  # the ramp
            engine.step()  # returns when the ramp's results are read: the steady state from here
        t0 = time.perf_counter()
        for _ in range(timed):
            engine.step()
        if not steady:
            _sync()
        best = min(best, (time.perf_counter() - t0) * 1e3 / timed)
        _sync()
    engine.drain()
    return best


def overlap_profile(engine: Engine, steps: int) -> dict:
    """Steady-state steps under the torch profiler: wall ms per step, the fraction of the wall time the GPU was
    busy (union of its kernel and copy intervals over the wall time) and the blocking host reads per step.

    That first window opens on an idle GPU (synchronised before it), so it carries the loop's ramp-up: the host
    scheduling and launching the first step while the GPU waits, and the profiler's first graph launch. A second
    window opens with steps in flight (no synchronise before it) and reports ``gpu_busy_fraction_steady``: the
    union of its intervals over their span, from the first interval it records to the last."""
    for _ in range(3):
        engine.step()
    _sync()
    blocking = engine.host_reads.blocking
    with _device_profile() as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    syncs = (engine.host_reads.blocking - blocking) / steps
    busy, span_us, gaps = _busy(prof)
    for _ in range(3):  # in flight again, then the steady window
        engine.step()
    with _device_profile() as prof:
        for _ in range(steps):
            engine.step()
        _sync()
    engine.drain()
    steady_busy, steady_span, _ = _busy(prof)
    # where the idle time is: many short gaps between a step's kernels (launch latency, the profiler's own
    # per-kernel cost) or few long ones (the GPU waiting for the host); what is outside the first to the last
    # interval is the window's start and end
    short = sum(g for g, _, _ in gaps if g < 10.0)
    top = sorted(gaps, reverse=True)[:5]
    return dict(ms_per_step=wall_us / 1e3 / steps, gpu_busy_fraction=min(busy / wall_us, 1.0),
                gpu_busy_fraction_steady=steady_busy / steady_span if steady_span else 0.0,
                blocking_syncs_per_step=syncs,
                idle_us_per_step=dict(short_gaps=short / steps, long_gaps=(sum(g for g, _, _ in gaps) - short) / steps,
                                      outside_span=max(wall_us - span_us, 0.0) / steps),
                longest_gaps=[dict(us=round(g, 1), after=p[:60], before=n[:60]) for g, p, n in top])


def _device_profile():
    """The torch profiler with CUDA activity only on a GPU (the CPU activity's bookkeeping would slow the host
    being measured); the CPU engine (tests) gets a CPU profile, which has no device intervals: busy 0."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])


def _busy(prof) -> tuple[float, float, list[tuple[float, str, str]]]:
    """The device intervals of a profile: their union (us), their span from the first start to the last end (us),
    and the gaps between them as (idle us, the interval before, the one after)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if getattr(e, "device_type", None) == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, cur_start, cur_end, prev_name = 0.0, None, None, ""
    gaps = []
    for a, b, name in spans:  # union of the intervals (one stream, but be safe)
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
                gaps.append((a - cur_end, prev_name, name))
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
        if b >= cur_end:
            prev_name = name
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy, (cur_end - spans[0][0]) if spans else 0.0, gaps


def prefill_times(engine: Engine, prompt: list[int], runs: int) -> list[float]:
    """Wall milliseconds of ``runs`` prefills of ``prompt`` from an idle device, each one engine step of a fresh
    request (freed after it); the first also compiles what it launches."""
    times = []
    for _ in range(runs):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        _sync()
        t0 = time.perf_counter()
        engine.step()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
        clear(engine, [rid])
    return times


def clear(engine: Engine, rids: list[str]) -> None:
    engine.drain()
    for rid in rids:
        engine.discard(rid)


def graph_alone_ms(eng: Engine, name: str, iters: int) -> float | None:
    """Milliseconds of one replay of the staged graph ``name`` (the decode or the fused speculative step) for the
    engine's next scheduled batch, timed with CUDA events (the GPU's time alone); None when no graph of that name
    fits the batch. Each replay advances the committed lengths in the request table; they are put back after every
    replay (one small copy, timed with it), so every replay runs at the same positions."""
    worker = eng.model_worker
    sched = eng.scheduler.schedule()
    if sched is None:
        raise RuntimeError(f"no request left to run the {name} graph for (finished at the length limit?)")
    if worker.graphs is None or not worker.graphs.can_run(name, len(sched.reqs)):
        return None
    lens = worker.caches.req_slots.seq_len
    saved = lens.clone()

    def replay():
        worker.run_staged(name, sched)
        lens.copy_(saved)
    return _time_cuda(replay, iters=iters)
