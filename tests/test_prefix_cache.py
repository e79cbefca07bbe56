"""Hybrid prefix caching: a conversation's next turn, and requests sharing a system prompt, reuse the KV and the
linear-attention state the engine already computed, exactly (the same tokens as with the cache off) under the
overlap loop, speculation, preemption, eviction and tensor parallelism; everything goes back when all ends."""

import os
import time

import pytest

from hylo import LLM, SamplingParams

from helpers import all_freed, cycle_steps, random_prompts, run_all, spec_engine, vocab_of, write_snapshot_count


def _conversation(on, off, vocab, turns, params, seed):
    """Turn t's prompt is turn t-1's prompt and output plus a new user message; returns each turn's outputs with
    the cache on and off."""
    users = random_prompts(vocab, [7, 3, 11, 5, 9][:turns], seed=seed)
    prompt, got = [], []
    for user in users:
        prompt = prompt + user
        a, b = run_all(on, [prompt], params)[0], run_all(off, [prompt], params)[0]
        got.append((prompt, a, b))
        prompt = prompt + a.token_ids
    return got


def _cached_engine(path, cache=True, spec=None, **opts):
    return spec_engine(path, spec, enable_prefix_caching=cache, **opts)


GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, seed=17, ignore_eos=True)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_conversation_reuses_everything_computed_and_is_exact(ckpt_a, params, overlap):
    on, off = _cached_engine(ckpt_a, overlap=overlap), _cached_engine(ckpt_a, cache=False, overlap=overlap)
    turns = _conversation(on, off, vocab_of(ckpt_a), 4, params, seed=1)
    for i, (prompt, a, b) in enumerate(turns):
        assert a.token_ids == b.token_ids, i
        assert b.num_cached_tokens == 0
        if i:  # everything the previous turn computed: its prompt and output but the last, never-fed token
            prev_prompt, prev, _ = turns[i - 1]
            assert a.num_cached_tokens == len(prev_prompt) + len(prev.token_ids) - 1, i
    assert on.prefix_cache.stats.hit_tokens == sum(a.num_cached_tokens for _, a, _ in turns)
    assert all_freed(on) and all_freed(off)


@pytest.mark.parametrize("spec", ["ngram", "mtp"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_conversation_under_speculation_is_exact(ckpt_a_mtp, spec, params):
    """With MTP or n-gram drafts the outputs are those of the same speculative engine with the cache off (seeded
    sampling too: the drafts after a hit are the ones without it), and each turn reuses everything the previous one
    computed but its last token: no verify accepts a draft past a request's end (its max_tokens here)."""
    # both engines cycle through plain, drafting-plain and verify steps (the same choices: the adaptive policy's
    # follow measured step times, and a sampled row's draws depend on which kind of step emits them)
    on = cycle_steps(_cached_engine(ckpt_a_mtp, spec=spec))
    off = cycle_steps(_cached_engine(ckpt_a_mtp, cache=False, spec=spec))
    turns = _conversation(on, off, vocab_of(ckpt_a_mtp), 4, params, seed=2)
    for i, (prompt, a, b) in enumerate(turns):
        assert a.token_ids == b.token_ids, i
        if i:
            prev_prompt, prev, _ = turns[i - 1]
            assert a.num_cached_tokens == len(prev_prompt) + len(prev.token_ids) - 1, i
    assert all_freed(on)


def test_shared_system_prompt_is_reused_whole(ckpt_b):
    """The second request computes from the last snapshot inside the shared system prompt and keeps one where its
    tokens leave the first request's; every later request reuses the whole system prompt."""
    vocab = vocab_of(ckpt_b)
    system = random_prompts(vocab, [37], seed=3)[0]
    users = random_prompts(vocab, [5, 9, 4, 12, 6], seed=4)
    on, off = _cached_engine(ckpt_b), _cached_engine(ckpt_b, cache=False)
    outs = [run_all(on, [system + u], GREEDY)[0] for u in users]
    ref = run_all(off, [system + u for u in users], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens == 32  # the chunk-end snapshot (chunk_size 16) inside the system prompt
    assert [o.num_cached_tokens for o in outs[2:]] == [37, 37, 37]
    assert all_freed(on)


def test_eviction_keeps_results_exact(ckpt_a):
    """A small KV pool and few snapshots: many distinct prompts push an old conversation out (least recently used
    first); asking it again is still exact, and the pools come back whole."""
    vocab = vocab_of(ckpt_a)
    on = _cached_engine(ckpt_a, kv_cache_tokens=220, max_model_len=100, prefix_snapshots=3, max_num_seqs=2)
    off = _cached_engine(ckpt_a, cache=False, kv_cache_tokens=220, max_model_len=100, max_num_seqs=2)
    convo = random_prompts(vocab, [30], seed=5)[0]
    first = run_all(on, [convo], GREEDY)[0]
    assert first.token_ids == run_all(off, [convo], GREEDY)[0].token_ids
    others = random_prompts(vocab, [25 + i % 9 for i in range(12)], seed=6)
    assert [o.token_ids for o in run_all(on, others, GREEDY)] == [o.token_ids for o in run_all(off, others, GREEDY)]
    stats = on.prefix_cache.stats
    assert stats.kv_evicted > 0 and stats.snapshots_evicted > 0
    assert on.prefix_cache.num_snapshots <= 3
    again = convo + first.token_ids + [1, 2, 3]
    assert run_all(on, [again], GREEDY)[0].token_ids == run_all(off, [again], GREEDY)[0].token_ids
    assert all_freed(on)


@pytest.mark.parametrize("snapshots", [1, 2, 4])
def test_a_turn_regenerated_shorter_is_served_exactly(ckpt_a, snapshots):
    """The same turn asked again with fewer tokens ends inside an edge the tree holds: the insert splits it, and
    making room for the new turn-end snapshot evicts the longer turn's, below the split. That eviction took the
    split node out too (a KeyError out of the engine, its slots never freed); now the node keeps its place."""
    vocab = vocab_of(ckpt_a)
    on = _cached_engine(ckpt_a, max_num_seqs=2, chunk_size=16, prefix_snapshots=snapshots)
    off = _cached_engine(ckpt_a, cache=False, max_num_seqs=2, chunk_size=16)
    p1 = random_prompts(vocab, [13], seed=31)[0]
    turn = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    p2 = p1 + run_all(on, [p1], turn(2))[0].token_ids
    for n in (7, 3, 5, 1, 7):
        assert run_all(on, [p2], turn(n))[0].token_ids == run_all(off, [p2], turn(n))[0].token_ids, n
    assert on.prefix_cache.num_snapshots <= snapshots
    assert all_freed(on)


def test_preempted_request_resumes_from_its_cached_prefix(ckpt_a):
    """KV runs out mid-decode: the newest request is preempted, its computed tokens go into the cache, and it
    resumes from there when readmitted; the outputs are the roomy engine's."""
    vocab = vocab_of(ckpt_a)
    prompts = random_prompts(vocab, [20, 25, 18, 22], seed=9)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5)
    ref = LLM(ckpt_a, verbose=False, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    tight = LLM(ckpt_a, kv_cache_tokens=70, max_model_len=50, chunk_size=32, verbose=False)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert sum(o.num_preemptions for o in outs) > 0
    assert tight.engine.prefix_cache.stats.resumed_tokens > 0  # a readmission reused its own computed tokens
    assert all_freed(tight.engine)


def test_cache_off_and_prompt_logits(ckpt_a):
    """``enable_prefix_caching=False`` builds no cache; prompt_logits always computes every position."""
    off = _cached_engine(ckpt_a, cache=False)
    assert off.prefix_cache is None
    on = _cached_engine(ckpt_a)
    prompt = random_prompts(vocab_of(ckpt_a), [40], seed=10)[0]
    run_all(on, [prompt], GREEDY)
    assert (on.prompt_logits(prompt) - off.prompt_logits(prompt)).abs().max().item() < 1e-5
    assert on.prompt_logits(prompt).shape[0] == 40


def test_tensor_parallel_ranks_cache_the_same(ckpt_a, tmp_path):
    """Two ranks (gloo) with the cache on: each caches its own shard by the same decisions; a second turn hits
    and gives one rank's tokens; dropping the cache drops it on every rank."""
    vocab = vocab_of(ckpt_a)
    first = random_prompts(vocab, [21], seed=12)[0]
    one = LLM(ckpt_a, verbose=False, enable_prefix_caching=False)
    two = LLM(ckpt_a, verbose=False, tensor_parallel_size=2)
    try:
        a = two.generate([first], GREEDY, use_tqdm=False)[0]
        assert a.token_ids == one.generate([first], GREEDY, use_tqdm=False)[0].token_ids
        nxt = first + a.token_ids + [4, 5]
        b = two.generate([nxt], GREEDY, use_tqdm=False)[0]
        assert b.num_cached_tokens == len(first) + len(a.token_ids) - 1
        assert b.token_ids == one.generate([nxt], GREEDY, use_tqdm=False)[0].token_ids
        assert two.engine.reset_prefix_cache()  # every rank drops its cache, or their next plans would differ
        two.engine.run_on_all(write_snapshot_count, str(tmp_path))
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # (a follower's file may be open still)
        assert sorted((tmp_path / f).read_text() for f in os.listdir(tmp_path)) == ["0", "0"]
    finally:
        two.close()
