"""``hylo bench --structured``: constrained decoding's cost in the engine loop (issue 39).

On a benchmark shape's random weights, with a synthetic byte-level vocabulary of the model's width (the 256 bytes,
then pieces of lowercase letters and spaces: a JSON string's inside allows nearly every token, its quote is one
byte-token, so a random model stays in its string fields as a model writing free text does): the compile time of
a JSON schema (cold, then cached), then per batch size the time per generated token of the same batch with no
constraint (timed before and after, the better kept) and with half of its requests under the schema, greedy and
sampled, and the blocking host reads per steady step of the constrained batch (the overlap loop's one read of the
step's tokens, one step late, is not blocking; a host matcher would add one per step).
"""

from __future__ import annotations

import dataclasses
import platform
import random
import time

import torch

from ..constrain.automaton import AutomatonCache
from ..constrain.spec import Constraint
from .run import build_model, release_gpu_memory, results_file
from .shapes import bench_config, check_cpu_shape
from .spec_policy import _engine, per_token_ms
from .steps import clear, fake_prefill, overlap_profile

CONTEXT = 1024
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "tags": {"type": "array", "items": {"enum": ["news", "sport", "tech", "other"]}, "maxItems": 4},
    "summary": {"type": "string"},
    "score": {"type": "integer"},
    "draft": {"type": "boolean"}}, "required": ["title", "summary", "score"]}


class SyntheticTokenizer:
    """Token ids 0..255 are the bytes; the rest random pieces of 2-8 lowercase letters and spaces (distinct)."""

    special_ids: set = set()

    def __init__(self, vocab: int, seed: int = 0):
        rng = random.Random(seed)
        self.vocab_size = vocab
        pieces, seen = [bytes([b]) for b in range(256)], set()
        letters = "abcdefghijklmnopqrstuvwxyz "
        while len(pieces) < vocab:
            p = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8))).encode()
            if p not in seen:
                seen.add(p)
                pieces.append(p)
        self._pieces = pieces

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._pieces[i] for i in ids).decode("utf-8", errors="replace")


def run_structured_bench(model_name: str = "bench-6b", out_dir: str = "bench/results", quick: bool = False,
                         device: str | None = None) -> list[dict]:

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_cpu_shape(model_name, device)
    mc = bench_config(model_name)
    tok = SyntheticTokenizer(mc.vocab_size)
    lm = dataclasses.replace(build_model(mc, device, name=model_name), tokenizer=tok)
    big = device == "cuda" and not quick
    batches = (8, 64) if big else (2,)
    warmup, steps = (20, 60) if big else (3, 6)
    meta = dict(model=model_name, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                torch=torch.__version__, host=platform.node(), context=CONTEXT, schema=SCHEMA, warmup_steps=warmup,
                timed_steps=steps, vocab=mc.vocab_size)
    records: list[dict] = []
    path, save = results_file(out_dir, f"structured-{model_name}", meta, records)

    constraint = Constraint.json_schema(SCHEMA)
    cache = AutomatonCache(tok, mc.vocab_size)
    t0 = time.perf_counter()
    auto = cache.get(constraint)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.get(constraint)
    meta.update(compile_seconds=cold, cached_seconds=time.perf_counter() - t0, states=auto.num_states,
                distinct_masks=len(auto.masks), transitions=len(auto.keys), automaton_mib=auto.nbytes / 2 ** 20)
    print(f"[bench] schema compiled in {cold:.2f} s ({auto.num_states} states, {len(auto.masks)} distinct masks, "
          f"{len(auto.keys)} transitions, {auto.nbytes / 2 ** 20:.1f} MiB); cached: "
          f"{meta['cached_seconds'] * 1e6:.0f} us", flush=True)
    eng = _engine(lm, device, max(batches), None, tuple(batches))
    eng.automata = cache  # compiled above
    # the benchmark shapes have no end-of-sequence token, which a constraint ends with: a control byte stands for
    # it (no JSON text allows one; the free rows ignore it)
    eng.eos_ids = eng.model_worker.eos_ids = {3}
    for bs in batches:
        for temp in (0.0, 0.8):
            free = fake_prefill(eng, bs, CONTEXT, temperature=temp)
            base = first = per_token_ms(eng, free, warmup, steps)[0]
            clear(eng, free)
            half = fake_prefill(eng, bs - bs // 2, CONTEXT, temperature=temp)
            half += fake_prefill(eng, bs // 2, CONTEXT, temperature=temp, constraint=constraint)
            ms = per_token_ms(eng, half, warmup, steps)[0]
            prof = overlap_profile(eng, steps // 2) if big else {}
            still = sum(not eng.request(r).finished for r in half)
            clear(eng, [r for r in half if not eng.request(r).finished])
            # the free batch once more, after: a first batch of a size or sampler may pay for what the second
            # does not (session 26: the first sampled batch of 64 ran 1.5x slower than the constrained one)
            free = fake_prefill(eng, bs, CONTEXT, temperature=temp)
            again = per_token_ms(eng, free, warmup, steps)[0]
            clear(eng, free)
            base = min(base, again)
            rec = dict(batch_size=bs, temperature=temp, free_ms_per_token=base, free_runs_ms_per_token=(first, again),
                       half_constrained_ms_per_token=ms,
                       ratio=ms / base, requests_still_running=still,
                       blocking_syncs_per_step=prof.get("blocking_syncs_per_step"),
                       gpu_busy_fraction=prof.get("gpu_busy_fraction"))
            records.append(rec)
            save()
            print(f"[bench] bs={bs} temperature={temp}: free {base:.3f} ms/token, half under the schema "
                  f"{ms:.3f} ms/token ({ms / base:.3f}x), blocking reads/step "
                  f"{rec['blocking_syncs_per_step']}, {still}/{bs} still running", flush=True)
    del eng
    if device == "cuda":
        release_gpu_memory()
    save()
    print(f"[bench] wrote {path}", flush=True)
    return records
