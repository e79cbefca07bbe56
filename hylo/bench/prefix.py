"""``hylo bench --prefix-replay``: multi-turn conversations replayed through the engine with the prefix cache on and
off, side by side (issue 34's benchmark).

The workload: ``conversations`` conversations of ``turns`` turns that all start with one shared system prompt; each
turn's prompt is the previous turn's prompt and output plus a new user message; conversations start at staggered
steps and each next turn arrives as soon as the previous one finished (closed loop). Reported per mode:
- prompt tokens, tokens reused from the cache, and the ideal: the prompt tokens that an earlier request's tokens
  (its prompt or output) already covered, a prefix-trie count over everything seen before;
- time to first token by turn, the replay's wall time, the prefill tokens computed;
then, on an idle engine, the time to first token of a turn whose prefix is cached against a fresh prompt of only its
new tokens, and the decode step with the cache on against off.
"""

from __future__ import annotations

import random
import time

import torch

from ..config import EngineConfig
from .shapes import bench_config, check_cpu_shape
from ..sampling_params import SamplingParams
from ..engine.engine import Engine, LoadedModel
from .steps import clear, fake_prefill, time_steps


class _Trie:
    """Token sequences seen so far; ``seen(tokens)`` is the longest prefix of ``tokens`` one of them starts with."""

    def __init__(self):
        self.root: dict = {}

    def add(self, tokens: list[int]) -> None:
        node = self.root
        for t in tokens:
            node = node.setdefault(t, {})

    def seen(self, tokens: list[int]) -> int:
        node, n = self.root, 0
        for t in tokens:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n


def workload(vocab: int, conversations: int, turns: int, system: int, user: tuple[int, int],
             output: tuple[int, int], seed: int = 0):
    """The shared system prompt, and per conversation its start step and (user message, output length) per turn."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    sys_prompt = tok(system)
    convs = [(c * 2 + rng.randrange(2), [(tok(rng.randint(*user)), rng.randint(*output)) for _ in range(turns)])
             for c in range(conversations)]
    return sys_prompt, convs


def replay(engine: Engine, sys_prompt: list[int], convs, max_steps: int = 10 ** 6) -> dict:
    """Run the conversations through ``engine``; returns the replay's figures."""
    trie = _Trie()
    state = {}  # conversation -> (turn, prompt so far, request id, arrival time)
    pending = sorted((start, c) for c, (start, _) in enumerate(convs))
    step, t0 = 0, time.perf_counter()
    ttft: dict[int, list[float]] = {}
    prompt_tokens = ideal = hits = 0
    done = 0

    def submit(c, turn, history):
        nonlocal prompt_tokens, ideal
        user, out_len = convs[c][1][turn]
        prompt = history + user
        ideal_here = min(trie.seen(prompt), len(prompt) - 1)
        prompt_tokens += len(prompt)
        ideal += ideal_here
        trie.add(prompt)  # seen from its arrival on (a later request may reuse it while it still runs)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True),
                                 request_id=f"c{c}t{turn}")
        state[c] = (turn, prompt, rid, time.perf_counter(), False)

    kinds: dict[str, list[float]] = {}  # step kind -> [steps, seconds, tokens]

    while (pending or state) and step < max_steps:
        while pending and pending[0][0] <= step:
            _, c = pending.pop(0)
            submit(c, 0, list(sys_prompt))
        t_step = time.perf_counter()
        finished_now = engine.step()
        plan = engine.launched_plan()
        if plan is not None:  # where the replay's time goes: steps by kind (the host's time from launch to launch)
            kind = plan.mode.name.lower() + ("" if plan.num_tokens == len(plan.reqs) else "+prefill")
            k = kinds.setdefault(kind, [0, 0.0, 0])
            k[0] += 1
            k[1] += time.perf_counter() - t_step
            k[2] += plan.num_tokens
        for req in finished_now:
            c, turn = (int(x) for x in req.rid[1:].split("t"))
            t, prompt, rid, arrived, got_first = state[c]
            if req.output_ids and not got_first:
                ttft.setdefault(turn, []).append(time.perf_counter() - arrived)
                state[c] = (t, prompt, rid, arrived, True)
            if req.finished:
                out = engine.pop_finished(rid)
                trie.add(prompt + out.token_ids)
                del state[c]
                done += 1
                hits += out.num_cached_tokens
                if turn + 1 < len(convs[c][1]):
                    submit(c, turn + 1, prompt + out.token_ids)
        step += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return dict(requests=done, steps=step, wall_s=wall, prompt_tokens=prompt_tokens, hit_tokens=hits,
                ideal_hit_tokens=ideal, computed_prompt_tokens=prompt_tokens - hits,
                hit_rate=hits / prompt_tokens if prompt_tokens else 0.0,
                ideal_hit_rate=ideal / prompt_tokens if prompt_tokens else 0.0,
                hit_vs_ideal=hits / ideal if ideal else 1.0,
                ttft_mean_s_by_turn={t: sum(v) / len(v) for t, v in sorted(ttft.items())},
                steps_by_kind={k: dict(steps=n, seconds=sec, tokens=tok, ms_per_step=1e3 * sec / n)
                               for k, (n, sec, tok) in kinds.items()})


def ttft_against_fresh(engine: Engine, vocab: int, sys_prompt: list[int], pairs: int, new: int, seed: int = 1) -> dict:
    """On an idle engine: the time to first token of a next turn whose prefix is cached (``new`` tokens to
    compute) against a fresh prompt of ``new`` random tokens, ``pairs`` times each, best of each."""
    rng = random.Random(seed)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def first_token(prompt) -> tuple[float, int]:
        rid = engine.add_request(prompt, one)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        dt = time.perf_counter() - t0
        return dt, engine.pop_finished(rid).num_cached_tokens

    hit_t, fresh_t, cached = [], [], []
    for i in range(pairs):
        history = sys_prompt + [rng.randrange(vocab) for _ in range(300)]
        first_token(history)  # caches the history (its last token excepted)
        dt, m = first_token(history + [rng.randrange(vocab) for _ in range(new)])
        hit_t.append(dt)
        cached.append(m)
        fresh_t.append(first_token([rng.randrange(vocab) for _ in range(new + 1)])[0])
    return dict(pairs=pairs, new_tokens=new + 1, cached_tokens=min(cached), ttft_hit_s=min(hit_t),
                ttft_fresh_s=min(fresh_t), ratio=min(hit_t) / min(fresh_t))


def decode_on_off(lm: LoadedModel, bs: int, ctx: int, steps: int, device: str) -> dict:
    """The steady decode step of ``bs`` requests at context ``ctx`` with the prefix cache on and off."""
    out = {}
    for on in (False, True, False, True):  # interleaved, best of two each
        ec = EngineConfig(max_num_seqs=bs, kv_cache_tokens=bs * (ctx + 300), chunk_size=8192, verbose=False,
                          cuda_graph_sizes=(bs,), enable_prefix_caching=on, prefix_snapshots=bs if on else None)
        eng = Engine(lm, device=device, dtype="bfloat16" if device == "cuda" else "float32", engine_config=ec)
        rids = fake_prefill(eng, bs, ctx)
        ms = time_steps(eng, steps)
        clear(eng, rids)
        del eng
        out[on] = min(out.get(on, ms), ms)
    return dict(batch_size=bs, context=ctx, ms_cache_off=out[False], ms_cache_on=out[True],
                ratio=out[True] / out[False])


def run_prefix_bench(model_name: str = "bench-6b", out_dir: str = "bench/results", quick: bool = False,
                     device: str | None = None, conversations: int | None = None, turns: int | None = None) -> dict:
    """The replay with the cache on and off, the time to first token of a cached turn against a fresh prompt of its
    new tokens, and the decode step with the cache on and off; one JSON under ``out_dir``."""
    import json
    import os
    import platform

    from .run import build_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_cpu_shape(model_name, device)
    mc = bench_config(model_name)
    lm = build_model(mc, device, name=model_name)
    big = model_name != "tiny" and not quick
    # 32 conversations of 5 turns: a 2k-token system prompt, user messages of 64-384 tokens, answers of 16-96
    # (64 x 6 with 256-token answers did not finish inside one device call's limit: every step that a new turn's
    # prefill shares with the decoding rows runs eagerly)
    conv, turns = conversations or (32 if big else 6), turns or (5 if big else 3)
    system, user, output = (2048, (64, 384), (16, 96)) if big else (40, (3, 12), (2, 8))
    sys_prompt, convs = workload(mc.vocab_size, conv, turns, system, user, output)
    dtype = "bfloat16" if device == "cuda" else "float32"
    meta = dict(model=model_name, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                torch=torch.__version__, host=platform.node(), conversations=conv, turns=turns, system_tokens=system,
                user_tokens=list(user), output_tokens=list(output))
    result = {"meta": meta}
    for on in (True, False):
        ec = EngineConfig(max_num_seqs=conv, chunk_size=2048 if big else 16, verbose=on, enable_prefix_caching=on,
                          cuda_graph_sizes=tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= conv),
                          memory_budget_gb=24.0 if big else None)
        eng = Engine(lm, device=device, dtype=dtype, engine_config=ec)
        # a small replay of the same kind first, then an empty cache: the process's first prefills compile and
        # autotune their kernels (Triton, fla), which the first timed mode would otherwise pay alone (seconds per
        # step: session 23's first H100 runs)
        replay(eng, *workload(mc.vocab_size, min(conv, 4), 2, system, user, output, seed=1))
        while eng.has_unfinished():
            eng.step()
        assert eng.reset_prefix_cache()
        rec = replay(eng, sys_prompt, convs)
        print(f"[bench] prefix replay, cache {'on' if on else 'off'}: {rec['requests']} requests in {rec['wall_s']:.1f} "
              f"s, prompt tokens {rec['prompt_tokens']}, reused {rec['hit_tokens']} (ideal {rec['ideal_hit_tokens']}: "
              f"{rec['hit_vs_ideal']:.3f} of it), first-token time by turn "
              + ", ".join(f"{t}: {v * 1e3:.0f} ms" for t, v in rec["ttft_mean_s_by_turn"].items()), flush=True)
        print("[bench]   steps: " + ", ".join(f"{k} {v['steps']} x {v['ms_per_step']:.1f} ms ({v['tokens']} tokens)"
                                          for k, v in rec["steps_by_kind"].items()), flush=True)
        result["replay_cache_on" if on else "replay_cache_off"] = rec
        if on:
            result["ttft"] = ttft_against_fresh(eng, mc.vocab_size, sys_prompt, 3 if big else 2, 200 if big else 6)
            t = result["ttft"]
            print(f"[bench] first token of a cached turn ({t['cached_tokens']} cached, {t['new_tokens']} new): "
                  f"{t['ttft_hit_s'] * 1e3:.1f} ms against {t['ttft_fresh_s'] * 1e3:.1f} ms for a fresh prompt of "
                  f"its new tokens ({t['ratio']:.2f}x)", flush=True)
        del eng
        if device == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    result["decode"] = decode_on_off(lm, 64 if big else 2, 1024 if big else 40, 30 if big else 6, device)
    d = result["decode"]
    print(f"[bench] decode bs={d['batch_size']} ctx={d['context']}: cache on {d['ms_cache_on']:.3f} ms, off "
          f"{d['ms_cache_off']:.3f} ms ({d['ratio']:.3f}x)", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"prefix-{model_name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"[bench] wrote {path}", flush=True)
    return result
