"""How many eager torch ops the host issues per speculative step outside the model passes (which run as captured
graphs on the GPU): a CPU-only measure of the host work that the overlap loop must hide behind the GPU step.

Runs the ``tiny`` bench model on the CPU, plain decode and MTP (k = 3, simulated accept length 3.0), with the
graph passes captured as the GPU engine captures them (off CUDA the runner re-runs a pass at each replay), counts
every aten op under a dispatch mode, and pauses the count inside the replays. On the GPU each counted op that is
not a view is one eager kernel launch or copy (10-20 us of host time on the device machine's host).
Usage: python tools/count_host_ops.py [--bs 1 8] [--steps 10]
"""

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hylo.bench.run import build_model
from hylo.bench.shapes import bench_config
from hylo.bench.steps import fake_prefill
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.engine.graphs import _Replay
from hylo.speculative.setup import SpecSetup

VIEWS = ("view", "unsqueeze", "select", "slice", "reshape", "detach", "unbind", "lift_fresh", "alias", "expand")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def pause_inside(counter: OpCounter, cls, name: str) -> None:
    inner = getattr(cls, name)

    def wrapped(*args, **kwargs):
        counter.paused += 1
        try:
            return inner(*args, **kwargs)
        finally:
            counter.paused -= 1
    setattr(cls, name, wrapped)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    counter = OpCounter()
    pause_inside(counter, _Replay, "replay")
    lm = build_model(bench_config("tiny"), torch.device("cpu"))
    for bs, spec in [(bs, spec) for spec in (False, True) for bs in args.bs]:
        kw = (dict(speculative="mtp", num_speculative_tokens=3, simulate_accept_length=3.0, spec_policy="fixed")
              if spec else {})
        ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=bs, kv_cache_tokens=bs * 1400, chunk_size=8192, max_model_len=1300,
                          verbose=False, **kw)
        eng = Engine(lm, device="cpu", dtype="bfloat16", engine_config=ec, spec_setup=SpecSetup("mtp") if spec else None)
        eng.worker.capture_graphs([bs], verbose=False)
        fake_prefill(eng, bs, 1024)
        for _ in range(5):
            eng.step()
        counter.counts.clear()
        t0 = time.perf_counter()
        with counter:
            for _ in range(args.steps):
                eng.step()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        total = sum(counter.counts.values()) / args.steps
        views = sum(n for op, n in counter.counts.items() if any(v in op for v in VIEWS)) / args.steps
        print(f"{'MTP' if spec else 'plain'} batch {bs}: {total:.0f} eager ops per step outside the graph replays, "
              f"{total - views:.0f} of them not views ({ms:.1f} ms per step on this CPU, replays included)")
        for op, n in counter.counts.most_common(15):
            print(f"  {n / args.steps:6.1f}  {op}")
        del eng


if __name__ == "__main__":
    main()
