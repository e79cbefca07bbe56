"""``hylo bench``: speed on the GPU against the hardware's floors and against HF transformers, in one run.

Every figure is a ratio measured in the same process: the device-to-device copy rate and the bf16 matmul rate are
measured first and give each record its floor (bytes that must move over the copy rate, or FLOPs over the matmul
rate). Decode states are set up without running the prefill (random prompts, KV locations reserved, recurrent
states zero): the decode step's work does not depend on what the cache holds.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import time
from dataclasses import replace

import torch

from ..config import EngineConfig, ModelConfig
from ..engine.engine import Engine, LoadedModel
from .floors import Footprint, measure_copy_rate, measure_matmul_rate
from .shapes import bench_config
from .steps import clear, fake_prefill, graph_alone_ms, overlap_profile, prefill_times, time_steps
from ..models.registry import build_model as build_family_model, has_mtp_head
from ..models.random_init import RandomFp8Reader, RandomReader
from ..ops.triton_utils import pdl_settings
from ..parallel.group import SINGLE
from ..speculative.setup import SpecSetup

GB = 1e9
# the batch-1 and speculative engines decode from context 1k: the overlap records alone run about 100 steps of up
# to k + 1 tokens each, so they leave room for 1k more tokens per request (at 1300 the requests hit the length
# limit during the unprofiled window of session 12's first run, and the records after it were lost)
SPEC_MODEL_LEN = 2048
SPEC_KV_TOKENS = SPEC_MODEL_LEN + 128


# ---- set-up --------------------------------------------------------------------------------------------------
def build_model(mc: ModelConfig, device, seed: int = 0, hf_model=None, name: str = "bench-6b") -> LoadedModel:
    dtype = torch.bfloat16
    q = mc.quantization
    plain = mc.mamba is not None  # the Mamba2 families' norms multiply by their weight
    reader = (RandomFp8Reader(seed, device, q.block, plain_norms=plain) if q is not None
              else RandomReader(seed, device, plain_norms=plain))
    if hf_model is not None:
        if q is not None:
            raise ValueError(f"{name}: the HF comparison is not available for the FP8 shapes")
        from .hf import HFReader

        reader = HFReader(hf_model, reader)
    with torch.device(device):
        model = build_family_model(mc, dtype, device, SINGLE)
    model.load(reader)
    return LoadedModel(name, mc, model, reader, None, True)


# ---- the runs ------------------------------------------------------------------------------------------------
def run_bench(model_name: str = "bench-6b", vs_hf: bool = False, quick: bool = False, out_dir: str = "bench/results",
              seed: int = 0, pdl: bool = False, short: bool = False) -> list[dict]:
    """Every record, or with ``short`` the core ones (prefill 8192; graph decode at batch 1 / 8 / 64 from context 1k,
    and from 32k at batch 1 and 8; MTP k = 3 at accept 3.0 against plain at batch 1 / 8 / 64): what fits a large
    model beside its caches on one GPU, in one device call."""
    if not torch.cuda.is_available():
        raise ValueError("hylo bench needs a CUDA GPU")
    device = torch.device("cuda")
    records: list[dict] = []
    pdl_on, prefetch_on = pdl_settings()
    meta = dict(model=model_name, gpu=torch.cuda.get_device_name(), torch=torch.__version__, host=platform.node(),
                quick=quick, short=short, pdl=pdl_on and torch.cuda.get_device_capability()[0] >= 9, pdl_prefetch=prefetch_on,
                hf_note=("HF transformers cannot do speculative decoding on this model: generate() refuses assisted "
                         "generation for stateful models"))
    path, save = results_file(out_dir, model_name, meta, records)

    copy_rate, mm_rate = measure_copy_rate(device), measure_matmul_rate(device)
    print(f"[bench] copy {copy_rate / 1e12:.2f} TB/s, bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s", flush=True)
    meta.update(copy_rate_tb_s=copy_rate / 1e12, matmul_tflops=mm_rate / 1e12)
    mc = bench_config(model_name)

    hf_steps = {}
    hf_model = None
    if vs_hf:
        from .hf import build_hf, time_hf

        hf_model = build_hf(mc, device)
    t0 = time.perf_counter()
    lm = build_model(mc, device, seed, hf_model, name=model_name)
    print(f"[bench] {model_name}: {sum(p.numel() for p in lm.model.parameters()) / 1e9:.2f} B parameters built in "
          f"{time.perf_counter() - t0:.0f} s, {torch.cuda.memory_allocated() / 2 ** 30:.1f} GiB on the GPU", flush=True)
    if vs_hf:
        hf_steps = time_hf(hf_model, mc, [1, 8], quick)
        meta["hf_ms_per_step"] = hf_steps
        forget_hf_model(lm)
        del hf_model
        release_gpu_memory()

    batches = [1, 8] if quick else [1, 8, 64] if short else [1, 8, 64, 256]
    contexts = [1024] if quick else [1024, 32768]
    long_max_bs = 8 if short else 64  # the largest batch decoded from context 32k
    kv_tokens = max(max(b * 1024 for b in batches), long_max_bs * 32768 if not quick else 0) + 300 * max(batches)
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=max(batches), kv_cache_tokens=kv_tokens, chunk_size=8192, verbose=True,
                      cuda_graph_sizes=tuple(batches), max_model_len=40000)
    eng = _engine(lm, ec)
    fp = Footprint.of(lm.model, None, eng.caches)
    steps = 10 if quick else 30

    # prefill 1 x 8192
    prompt = torch.randint(0, mc.vocab_size, (8192,), generator=torch.Generator().manual_seed(1)).tolist()
    best = min(prefill_times(eng, prompt, 5))  # the first compiles; the best of all (the host's share is noisy)
    attn_flops = len(mc.attn_layer_ids) * 2 * mc.num_attention_heads * mc.head_dim * 8192 ** 2  # causal QK + PV
    flops = 2 * fp.matmul_params * 8192 + attn_flops
    floor = flops / mm_rate * 1e3
    records.append(dict(phase="prefill", batch_size=1, context=8192, cuda_graph=False, spec=None,
                        ms_per_step=best, ms_per_token=best / 8192, floor_ms=floor, floor_kind="compute",
                        ratio_to_floor=best / floor))
    print(f"[bench] prefill 8192: {best:.1f} ms, floor {floor:.1f} ms ({best / floor:.2f}x)", flush=True)

    # plain decode
    for ctx in contexts:
        for bs in batches:
            if ctx == 32768 and bs > long_max_bs:
                continue
            rids = fake_prefill(eng, bs, ctx)
            floor = fp.decode_bytes(bs, ctx) / copy_rate * 1e3
            for graphs in ((True,) if short else (True, False)):
                saved = eng.model_worker.graphs
                if not graphs:
                    eng.model_worker.graphs = None
                ms = time_steps(eng, steps if graphs else max(3, steps // 3))
                eng.model_worker.graphs, saved = saved, None  # no name may outlive the engine (its caches)
                rec = _decode_record(bs, ctx, graphs, ms, floor)
                if graphs and ctx == 1024 and bs in hf_steps:
                    rec["hf_ms_per_step"] = hf_steps[bs]
                    rec["speedup_vs_hf"] = hf_steps[bs] / ms
                records.append(rec)
                save()
                print(f"[bench] decode bs={bs} ctx={ctx} graphs={graphs}: {ms:.2f} ms/step, floor {floor:.2f} ms "
                      f"({ms / floor:.2f}x)" + (f", HF {hf_steps[bs]:.1f} ms" if "hf_ms_per_step" in rec else ""),
                      flush=True)
            if ctx == 1024 and not quick:
                records.append(_device_decode_record(eng, bs, ctx, floor))
            clear(eng, rids)
            if ctx == 1024 and bs in (1, 64) and not quick and not short:  # the same step for rows that sample (temperature 0.8)
                rids = fake_prefill(eng, bs, ctx, temperature=0.8)
                ms = time_steps(eng, steps)
                records.append(dict(_decode_record(bs, ctx, True, ms, floor), sampling="temperature 0.8"))
                save()
                print(f"[bench] decode bs={bs} ctx={ctx} graphs=True sampled (temperature 0.8): {ms:.2f} ms/step, "
                      f"floor {floor:.2f} ms ({ms / floor:.2f}x)", flush=True)
                clear(eng, rids)
    plain_ms = {r["batch_size"]: r["ms_per_token"] for r in records  # wall time, like the spec records
                if r["phase"] == "decode" and r["cuda_graph"] and r["context"] == 1024 and r["spec"] is None
                and not r.get("gpu_only") and not r.get("sampling")}
    del eng
    release_gpu_memory()

    print(f"[bench] plain engine dropped: {torch.cuda.memory_allocated() / 2 ** 30:.1f} GiB still allocated",
          flush=True)
    # speculative decoding, MTP k = 3, simulated acceptance
    k = 3
    spec_batches = [1, 8] if quick else [1, 8, 64]
    accepts = (3.0,) if short else (2.0, 3.0, 4.0)
    if not has_mtp_head(mc):
        # a family or a shape without an MTP head (Nemotron 3 Nano: its family has one, this release none): n-gram
        # speculation's verify step at the same simulated accept lengths (its drafts come from the host's token
        # history, no weights read); the Mamba2 states commit by checkpoints
        _spec_records(lm, spec_batches, accepts, "checkpoints", k, copy_rate, steps, plain_ms, records, save,
                      method="ngram")
        save()
        print(f"[bench] {model_name}: no MTP head, n-gram speculation only; wrote {path}",
              flush=True)
        return records
    eng = _spec_records(lm, spec_batches, accepts, "replay", k, copy_rate, steps, plain_ms, records, save)
    if short:
        save()
        print(f"[bench] wrote {path}", flush=True)
        return records

    # the overlap loop: speculative decoding with overlap on and off, GPU busy fraction and blocking reads
    for bs in ([1] if quick else [1, 64]):
        for overlap in (True, False):
            eng.ec = replace(eng.ec, overlap=overlap)
            eng.worker.simulate_accept_length = 3.0
            rec = _overlap_record(eng, bs, k, steps)
            records.append(rec)
            save()
            print(f"[bench] overlap={overlap} spec mtp bs={bs}: {rec['ms_per_step']:.2f} ms/step, "
                  f"{rec['ms_per_token']:.3f} ms/token, GPU busy {rec['gpu_busy_fraction']:.3f} "
                  f"(steady window {rec['gpu_busy_fraction_steady']:.3f}), "
                  f"{rec['blocking_syncs_per_step']:.2f} blocking reads/step"
                  + (f"; unprofiled: {rec['wall_ms_per_step_unprofiled']:.2f} ms/step, graph alone "
                     f"{rec['graph_ms_per_step']:.2f} ms, busy {rec['gpu_busy_fraction_unprofiled']:.3f}"
                     if "graph_ms_per_step" in rec else ""), flush=True)
            idle = rec["idle_us_per_step"]
            print(f"[bench]   idle us/step under the profiler: {idle['short_gaps']:.1f} in gaps < 10 us, "
                  f"{idle['long_gaps']:.1f} in longer ones, {idle['outside_span']:.1f} before the first / after "
                  f"the last kernel; longest: " + "; ".join(f"{g['us']:.0f} us {g['after'][:28]} -> "
                                                          f"{g['before'][:28]}" for g in rec["longest_gaps"][:3]),
                  flush=True)

    del eng
    release_gpu_memory()
    if not quick:  # the other commit of the accepted GDN state, for comparison in the same run
        _spec_records(lm, spec_batches, (3.0,), "checkpoints", k, copy_rate, steps, plain_ms, records, save)
        release_gpu_memory()  # the engine it returned is garbage now
    if pdl:
        _pdl_records(lm, [1] if quick else [1, 8, 64], copy_rate, steps, records, save)
    save()
    print(f"[bench] wrote {path}", flush=True)
    return records


def _spec_records(lm: LoadedModel, batches: list[int], accepts: tuple[float, ...], commit: str, k: int,
                  copy_rate: float, steps: int, plain_ms: dict, records: list[dict], save_records,
                  method: str = "mtp") -> Engine:
    """Speculative steps (MTP, or ``method="ngram"``; graphs, context 1k) at simulated accept lengths, per generated
    token against plain decode, with the accepted GDN state committed by ``commit`` (``EngineConfig.spec_commit``;
    Mamba2 layers always commit checkpoints). Returns the engine (the overlap records reuse it)."""
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=max(batches), kv_cache_tokens=max(batches) * SPEC_KV_TOKENS,
                      chunk_size=8192, speculative=method, num_speculative_tokens=k, simulate_accept_length=accepts[0],
                      cuda_graph_sizes=tuple(batches), max_model_len=SPEC_MODEL_LEN, spec_commit=commit,
                      spec_policy="fixed")  # the verify step itself, at every step (the policy: --spec-policy)
    setup = SpecSetup(method)
    eng = _engine(lm, ec, spec_setup=setup)
    fp = Footprint.of(lm.model, setup.mtp, eng.caches)
    for bs in batches:
        for accept in accepts:
            eng.worker.simulate_accept_length = accept
            rids = fake_prefill(eng, bs, 1024)
            ms = time_steps(eng, steps)
            reqs = [eng.request(r) for r in rids]
            emitted = sum(r.spec.emitted_tokens for r in reqs)
            verify_steps = sum(r.spec.verify_steps for r in reqs) / bs
            measured_len = emitted / max(sum(r.spec.verify_steps for r in reqs), 1)
            per_token = ms / (bs * measured_len)
            floor = fp.spec_step_bytes(bs, 1024, k, replay=commit == "replay") / copy_rate * 1e3
            rec = dict(phase="decode", batch_size=bs, context=1024, cuda_graph=True, spec=method,
                       num_speculative_tokens=k, accept_length=measured_len, target_accept_length=accept,
                       spec_commit=commit, ms_per_step=ms, ms_per_token=per_token, floor_ms=floor,
                       floor_ms_per_token=floor / (bs * accept), ratio_to_floor=ms / floor,
                       vs_plain_decode=per_token / plain_ms.get(bs, math.nan), verify_steps=verify_steps)
            records.append(rec)
            save_records()
            if abs(measured_len - accept) > 0.25:
                print(f"[bench] WARNING: simulated accept length {measured_len:.2f} measured against a target of "
                      f"{accept:.2f}", flush=True)
            print(f"[bench] spec {method} k={k} ({commit}) bs={bs} accept={measured_len:.2f}: {ms:.2f} ms/step, "
                  f"{per_token:.3f} ms/token ({rec['vs_plain_decode']:.2f}x plain), floor {floor:.2f} ms/step",
                  flush=True)
            clear(eng, rids)
    return eng


def _pdl_records(lm: LoadedModel, batches: list[int], copy_rate: float, steps: int, records: list[dict],
                 save_records) -> None:
    """The decode (graphs, context 1k) measurements again with the kernel launches the main run did not use:
    programmatic dependent launch off, and on with the L2 weight prefetch; plus the batch-1 speculative overlap
    profile with PDL off. Appended to ``records`` (tagged ``pdl``, ``pdl_prefetch``): a comparison inside one
    run."""
    from ..ops.triton_utils import set_pdl

    previous = set_pdl(*pdl_settings())
    try:
        for pdl, prefetch in ((False, False), (True, True)):
            set_pdl(pdl, prefetch)
            ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=max(batches), kv_cache_tokens=max(batches) * SPEC_KV_TOKENS,
                              chunk_size=8192, cuda_graph_sizes=tuple(batches), max_model_len=SPEC_MODEL_LEN,
                              verbose=False)
            eng = _engine(lm, ec)
            fp = Footprint.of(lm.model, None, eng.caches)
            for bs in batches:
                rids = fake_prefill(eng, bs, 1024)
                floor = fp.decode_bytes(bs, 1024) / copy_rate * 1e3
                ms = time_steps(eng, steps)
                tags = dict(pdl=pdl, pdl_prefetch=prefetch)
                records += [dict(_decode_record(bs, 1024, True, ms, floor), **tags),
                            dict(_device_decode_record(eng, bs, 1024, floor), **tags)]
                save_records()
                print(f"[bench] PDL {pdl} (prefetch {prefetch}) decode bs={bs}: {ms:.2f} ms/step ({ms / floor:.2f}x "
                      f"floor), graph alone {records[-1]['ms_per_step']:.2f} ms", flush=True)
                clear(eng, rids)
            del eng
        set_pdl(False, False)
        eng = _batch1_engine(lm, spec=True)
        records.append(dict(_overlap_record(eng, 1, 3, steps), pdl=False, pdl_prefetch=False))
        save_records()
        print(f"[bench] PDL off overlap spec mtp bs=1: {records[-1]['ms_per_step']:.2f} ms/step, GPU busy "
              f"{records[-1]['gpu_busy_fraction']:.3f}", flush=True)
    finally:
        set_pdl(*previous)


def forget_hf_model(lm: LoadedModel) -> None:
    """After the HF rows: ``lm``'s reader (``bench_hf.HFReader``) holds the HF model's state dict, the whole model
    a second time; only its fallback, which has the MTP head that HF drops, is needed from here on."""
    lm.reader = lm.reader.fallback


def results_file(out_dir: str, stem: str, meta: dict, records: list):
    """(path, save): the JSON file a bench mode writes its ``meta`` and ``records`` to, ``save()`` rewriting it
    whole after every record, so that a run cut short still leaves its numbers."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json")

    def save():
        with open(path, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return path, save


def release_gpu_memory() -> None:
    """Give the memory of dropped engines back: an engine's objects refer to each other (worker, graphs, caches),
    so they are freed by the cycle collector, not when the last name goes; until then the caching allocator cannot
    reuse their blocks (the 80 GB H100 ran out of memory at the bench's last engines, session 19)."""
    gc.collect()
    torch.cuda.empty_cache()


def _engine(lm: LoadedModel, ec: EngineConfig, spec_setup: SpecSetup | None = None) -> Engine:
    """A bench engine on the GPU in bfloat16, built after the memory of the ones before it is given back."""
    release_gpu_memory()
    return Engine(lm, device="cuda", dtype="bfloat16", engine_config=ec, spec_setup=spec_setup)


def _batch1_engine(lm: LoadedModel, spec: bool) -> Engine:
    """A batch-1 engine at context 1k with its graphs, plain or MTP (k = 3, simulated accept length 3.0): the
    comparison runs' engine."""
    ec = EngineConfig(enable_prefix_caching=False, max_num_seqs=1, kv_cache_tokens=SPEC_KV_TOKENS, chunk_size=8192, cuda_graph_sizes=(1,),
                      max_model_len=SPEC_MODEL_LEN,
                      verbose=False, **(dict(speculative="mtp", num_speculative_tokens=3, simulate_accept_length=3.0,
                                              spec_policy="fixed")
                                         if spec else {}))
    return _engine(lm, ec, spec_setup=SpecSetup("mtp") if spec else None)


def _decode_record(bs: int, ctx: int, graphs: bool, ms: float, floor: float) -> dict:
    return dict(phase="decode", batch_size=bs, context=ctx, cuda_graph=graphs, spec=None, ms_per_step=ms,
                ms_per_token=ms / bs, floor_ms=floor, ratio_to_floor=ms / floor)


def _overlap_record(eng: Engine, bs: int, k: int, steps: int) -> dict:
    """``steps`` profiled speculative steps of ``bs`` fresh requests at context 1k, with the engine's overlap
    setting: wall time, GPU busy fraction, blocking reads, measured accept length."""
    rids = fake_prefill(eng, bs, 1024)
    prof = overlap_profile(eng, steps)
    reqs = [eng.request(r) for r in rids]
    measured_len = sum(r.spec.emitted_tokens for r in reqs) / max(sum(r.spec.verify_steps for r in reqs), 1)
    try:
        extra = _unprofiled_busy(eng, steps) if eng.ec.overlap else {}
    except RuntimeError as exc:  # an auxiliary figure: report it missing rather than lose the run's other records
        print(f"[bench] WARNING: unprofiled busy fraction not measured: {exc}", flush=True)
        extra = {}
    clear(eng, rids)
    return dict(phase="decode", batch_size=bs, context=1024, cuda_graph=True, spec="mtp", num_speculative_tokens=k,
                accept_length=measured_len, overlap=eng.ec.overlap,
                ms_per_token=prof["ms_per_step"] / (bs * measured_len), **prof, **extra)


def _unprofiled_busy(eng: Engine, steps: int) -> dict:
    """The busy fraction without the profiler, whose per-kernel bookkeeping slows the host: the fused ``spec_step``
    graph replayed back to back (CUDA events: the GPU's time for one step) over the wall time of an unprofiled
    steady-state step."""
    graphs = eng.model_worker.graphs
    if graphs is None:
        return {}
    wall = time_steps(eng, steps)
    gpu = graph_alone_ms(eng, "spec_step", iters=steps)
    if gpu is None:
        return {}
    return dict(wall_ms_per_step_unprofiled=wall, graph_ms_per_step=gpu, gpu_busy_fraction_unprofiled=min(gpu / wall,
                                                                                                          1.0))


def _device_decode_record(eng: Engine, bs: int, ctx: int, floor: float) -> dict:
    """GPU time of the captured decode pass alone (no host work): the graph replay, timed with CUDA events."""
    ms = graph_alone_ms(eng, "decode", iters=30)
    if ms is None:
        raise RuntimeError(f"no captured decode graph fits batch {bs}")
    return dict(phase="decode", batch_size=bs, context=ctx, cuda_graph=True, spec=None, ms_per_step=ms,
                ms_per_token=ms / bs, floor_ms=floor, ratio_to_floor=ms / floor, gpu_only=True)
