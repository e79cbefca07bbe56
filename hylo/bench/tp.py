"""``hylo bench --tensor-parallel-size N``: decode steps of a random-weight benchmark model at tensor-parallel sizes
1 and N, with the share of GPU time spent in the collectives.

Every rank builds its own shard from random numbers (the values do not matter for speed, and no rank ever holds
the whole model: ``qwen3-next-80b`` is 160 GB in bfloat16). The harness sets up decoding states on every rank
through ``LeaderEngine.run_on_all``, so the ranks' engines stay identical.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from .shapes import bench_config
from .steps import clear, fake_prefill, time_steps
from ..config import EngineConfig, ModelConfig
from ..engine.engine import LoadedModel
from ..parallel.group import TPGroup
from ..launch import create_engine


@dataclass(frozen=True)
class RandomModel:
    """A model source: each rank builds its shard of ``bench_config(name)`` from random numbers."""

    name: str
    seed: int = 0

    def config(self) -> ModelConfig:
        return bench_config(self.name)

    def load(self, dtype: torch.dtype, device, tp: TPGroup) -> LoadedModel:
        from ..models.registry import build_model
        from ..models.random_init import RandomReader
        from ..parallel.sharding import local_config

        mc = self.config()
        local = local_config(mc, tp.size)
        reader = RandomReader(self.seed + 7919 * tp.rank, device)
        with torch.device(device):
            model = build_model(local, dtype, device, tp)
        model.load(reader)
        model.eval()
        return LoadedModel(self.name, mc, model, reader, None, True, local)


def _collective_share(engine, steps: int) -> float | None:
    """Fraction of rank 0's GPU kernel time spent in NCCL kernels over ``steps`` steady-state steps."""
    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.drain()
    total = nccl = 0.0
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        dur = e.time_range.end - e.time_range.start
        total += dur
        if "nccl" in e.name.lower():
            nccl += dur
    return nccl / total if total else None


def tp_decode_records(model: RandomModel, tp_size: int, device: str = "cuda", batches=(1, 8, 64), ctx: int = 1024,
                      steps: int = 30, dtype: str | None = None) -> list[dict]:
    """Decode ms per step at each batch size with ``tp_size`` ranks (graphs on where the device has them)."""
    dtype = dtype or ("bfloat16" if device != "cpu" else "float32")
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=max(batches), kv_cache_tokens=max(batches) * (ctx + 300), chunk_size=8192,
                      verbose=False, cuda_graph_sizes=tuple(batches), max_model_len=ctx + 200,
                      tensor_parallel_size=tp_size)
    eng = create_engine(model, device, dtype, ec)
    records = []
    try:
        for bs in batches:
            run = eng.run_on_all if tp_size > 1 else (lambda fn, *a: fn(eng, *a))
            rids = run(fake_prefill, bs, ctx)
            ms = time_steps(eng, steps)
            share = _collective_share(eng, min(steps, 10)) if tp_size > 1 else 0.0
            records.append(dict(phase="decode", model=model.name, tensor_parallel_size=tp_size, batch_size=bs,
                                context=ctx, cuda_graph=device != "cpu", spec=None, ms_per_step=ms,
                                ms_per_token=ms / bs, collective_share=share))
            print(f"[bench] {model.name} TP={tp_size} decode bs={bs}: {ms:.2f} ms/step"
                  + (f", collectives {share:.0%} of GPU time" if share else ""), flush=True)
            run(clear, rids)
    finally:
        if hasattr(eng, "close"):
            eng.close()
    return records


def run_tp_bench(model_name: str, tp_size: int, out_dir: str = "bench/results", quick: bool = False) -> list[dict]:
    if not torch.cuda.is_available() or torch.cuda.device_count() < tp_size:
        raise ValueError(f"hylo bench --tensor-parallel-size {tp_size} needs {tp_size} CUDA GPUs")
    batches = (1, 8) if quick else (1, 8, 64)
    records = []
    sizes = [tp_size] if model_name == "qwen3-next-80b" else [1, tp_size]  # the 80B model does not fit one GPU
    for size in sizes:
        records += tp_decode_records(RandomModel(model_name), size, "cuda", batches, steps=10 if quick else 30)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{model_name}-tp{tp_size}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"meta": {"model": model_name, "gpu": torch.cuda.get_device_name(), "gpus": tp_size,
                            "torch": torch.__version__}, "records": records}, f, indent=1)
    print(f"[bench] wrote {path}", flush=True)
    return records
