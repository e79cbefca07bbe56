"""Building engines: ``create_engine`` gives one Engine, or with tensor parallelism rank 0's engine driving the
follower processes (it sits above ``engine/``, which it builds, and ``parallel/``, whose pieces it uses).

Tensor parallelism across processes: one process per rank in one torch.distributed group (gloo on CPU, NCCL on
CUDA with NVLink multicast kept off), each holding its shard of the model and of the caches.

Every rank runs the same engine (scheduler, overlap loop, speculative decoding) on the same inputs, so their
decisions agree without being sent: rank 0 (the caller's process) sends each call that changes engine state (a
new request, an abort, a step) to the followers, over a pipe each, before running it itself; the collectives in
the forward pass (all-reduce after row-parallel projections, all-gather of vocab-parallel logits) keep the ranks
in step. Sampling is identical on every rank: the logits are gathered in full and the noise is keyed by request
seed.
"""

from __future__ import annotations

import os
import socket
import weakref
from dataclasses import replace
from datetime import timedelta

import torch

from .config import EngineConfig
from .engine.engine import Engine, LoadedModel
from .models.default import DEFAULT_MODEL_NAME, default_model_config, trained_default_path
from .models.hub import resolve as resolve_model
from .models.registry import read_config
from .parallel.group import TPGroup
from .parallel.sharding import check_divisible
from .speculative.setup import SpecSetup

# NVLink multicast can take the host's shared GPUs out of service: never let NCCL or symmetric memory use it
_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TIMEOUT_S = 1800  # the longest a collective may wait for a rank (model loading, first-use compilation included)
_MUTATING = ("abort", "step", "drain", "pop_finished", "discard", "prompt_logits", "reset_prefix_cache")


def create_engine(model, device: str, dtype: str, ec: EngineConfig):
    """An Engine, or with ``tensor_parallel_size > 1`` rank 0's engine driving the follower processes."""
    spec = SpecSetup(ec.speculative) if ec.speculative else None
    if ec.tensor_parallel_size == 1:
        return Engine(model, device=device, dtype=dtype, engine_config=ec, spec_setup=spec)
    return LeaderEngine(model, device, dtype, ec)


def _config_of(model):
    if isinstance(model, LoadedModel):
        raise ValueError("tensor parallelism loads the model in every rank process: pass a checkpoint path")
    if hasattr(model, "config") and callable(model.config):  # a model source (benchmarks)
        return model.config()
    if model is None:
        model = trained_default_path()
    if model is None or (model == DEFAULT_MODEL_NAME and not os.path.isdir(model)):
        return default_model_config()
    return read_config(resolve_model(model))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, size: int, port: int, device: str):
    import torch.distributed as dist

    os.environ.update(_SAFE_ENV)
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:  # before the process group: NCCL binds its communicator to the current device
        torch.cuda.set_device(rank)
    # a rank that dies (e.g. out of memory while loading) makes the others fail after this, not hang for good
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=TIMEOUT_S))
    return TPGroup(rank, size, None), f"cuda:{rank}" if cuda else "cpu"


def _follower(rank: int, size: int, port: int, model, device: str, dtype: str, ec: EngineConfig, conn) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    conn.send("started")  # the leader waits for this before it joins the group (see _await_followers)
    tp, rank_device = _init(rank, size, port, device)
    engine = Engine(model, device=rank_device, dtype=dtype, engine_config=replace(ec, verbose=False),
                    spec_setup=SpecSetup(ec.speculative) if ec.speculative else None, tp=tp)
    try:
        with torch.inference_mode():
            while True:
                try:  # calls arrive over a pipe: an idle leader (a quiet server) never times anything out
                    name, args, kwargs = conn.recv()
                except EOFError:  # the leader is gone
                    break
                if name == "stop":
                    break
                if name == "run_on_all":
                    args[0](engine, *args[1:], **kwargs)
                else:
                    getattr(engine, name)(*args, **kwargs)
    finally:
        dist.destroy_process_group()


def _await_followers(procs, conns, limit_s: float = 600.0) -> None:
    """Wait until every follower process runs ``_follower``: one that dies first (the usual cause: a script that
    builds the LLM at import time, without ``if __name__ == "__main__":``, which each spawned process re-runs)
    would otherwise leave rank 0 waiting in ``init_process_group`` for the whole collective timeout."""
    import time

    deadline = time.monotonic() + limit_s
    for rank, (proc, conn) in enumerate(zip(procs, conns), start=1):
        while True:
            try:
                if conn.poll(0.2) and conn.recv() == "started":
                    break
            except (EOFError, OSError):
                proc.join(5)
            if not proc.is_alive():
                raise RuntimeError(
                    f"tensor parallelism: the process of rank {rank} exited (code {proc.exitcode}) before it "
                    f"started; if the LLM is built by a script, build it under 'if __name__ == \"__main__\":' "
                    f"(every rank's process is spawned and imports the script again)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallelism: the process of rank {rank} did not start in {limit_s:.0f} s")


class LeaderEngine:
    """Rank 0: an Engine whose state-changing calls are mirrored on the followers first."""

    def __init__(self, model, device: str, dtype: str, ec: EngineConfig):
        import torch.multiprocessing as mp

        size = ec.tensor_parallel_size
        if device not in ("cpu", "auto", "cuda"):
            raise ValueError(f"tensor parallelism takes device 'cpu' or 'cuda' (rank r uses cuda:r), got {device!r}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        check_divisible(_config_of(model), size)  # before any process starts
        port = _free_port()
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(1, size)]
        self._conns = [parent for parent, _ in pipes]
        self._procs = [ctx.Process(target=_follower, args=(r, size, port, model, device, dtype, ec, child),
                                   daemon=True) for r, (_, child) in zip(range(1, size), pipes)]
        for p in self._procs:
            p.start()
        try:
            _await_followers(self._procs, self._conns)
        except BaseException:
            self._shutdown(self._procs, self._conns)
            raise
        tp, rank_device = _init(0, size, port, device)
        try:
            self._engine = Engine(model, device=rank_device, dtype=dtype, engine_config=ec,
                                  spec_setup=SpecSetup(ec.speculative) if ec.speculative else None, tp=tp)
        except BaseException:
            self._shutdown(self._procs, self._conns)
            raise
        self._finalizer = weakref.finalize(self, LeaderEngine._shutdown, self._procs, self._conns)

    def __getattr__(self, name):
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise AttributeError(name)
        attr = getattr(engine, name)
        if name == "add_request":  # host-only: validate and register here first, then mirror with the same id
            def add_request(*args, **kwargs):
                rid = attr(*args, **kwargs)
                req = engine.request(rid)
                # the seed rank 0 drew travels too, so every rank samples with the same noise
                self._broadcast(name, (req.prompt_ids, replace(req.params, seed=req.seed)), {"request_id": rid})
                return rid
            return add_request
        if name in _MUTATING:  # the followers first: these calls run collectives every rank must join
            def mirrored(*args, **kwargs):
                policy = engine.scheduler.policy
                if name == "step" and policy is not None and policy.adaptive:
                    # the speculation policy's choices follow the step costs only rank 0 measures
                    self._broadcast("set_step_costs", (policy.costs,), {})
                self._broadcast(name, args, kwargs)
                return attr(*args, **kwargs)
            return mirrored
        return attr

    def run_on_all(self, fn, *args, **kwargs):
        """``fn(engine, *args)`` on every rank (``fn`` a module-level function: it travels by name); rank 0's
        result is returned. For harnesses that set engine state up directly (benchmarks)."""
        self._broadcast("run_on_all", (fn, *args), kwargs)
        return fn(self._engine, *args, **kwargs)

    def _broadcast(self, name, args, kwargs) -> None:
        for conn in self._conns:
            conn.send((name, args, kwargs))

    def close(self) -> None:
        self._finalizer()
        engine = self.__dict__.pop("_engine", None)
        if engine is not None:
            engine.close()

    @staticmethod
    def _shutdown(procs, conns) -> None:
        import torch.distributed as dist

        for conn in conns:
            try:
                conn.send(("stop", (), {}))
                conn.close()
            except (OSError, BrokenPipeError):
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
