"""Engine behaviour: continuous batching, admission and preemption, stop conditions, abort, seeds."""

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine

from helpers import all_freed, random_prompts, vocab_of

GREEDY = SamplingParams(max_tokens=10, temperature=0)


def _run_all(engine, prompts, params):
    rids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(r) for r in rids]


def _free_everything(engine):
    return all_freed(engine)


def test_request_joining_a_running_batch_matches_running_alone(ckpt_a):
    prompts = random_prompts(vocab_of(ckpt_a), [12, 30, 5], seed=7)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=123)
    for params in (GREEDY, sampled):
        alone = _run_all(Engine(ckpt_a, engine_config=EngineConfig(verbose=False)), [prompts[2]], params)[0]
        eng = Engine(ckpt_a, engine_config=EngineConfig(verbose=False, chunk_size=8))
        first = [eng.add_request(p, params) for p in prompts[:2]]
        for _ in range(6):  # the first two are mid-prefill / decoding when the third arrives
            eng.step()
        late = eng.add_request(prompts[2], params)
        while eng.has_unfinished():
            eng.step()
        assert eng.pop_finished(late).token_ids == alone.token_ids
        assert all(eng.pop_finished(r).finished for r in first)


def test_ten_times_more_requests_than_slots(ckpt_b):
    prompts = random_prompts(vocab_of(ckpt_b), [3 + (i * 7) % 40 for i in range(20)], seed=8)
    params = [SamplingParams(max_tokens=4 + i % 5, temperature=0) for i in range(20)]
    llm = LLM(ckpt_b, max_num_seqs=2, chunk_size=16, verbose=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 20 and all(o.finished for o in outs)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert _free_everything(llm.engine)
    small = LLM(ckpt_b, max_num_seqs=2, verbose=False)
    for i in range(0, 20, 2):
        group = small.generate(prompts[i:i + 2], params[i:i + 2], use_tqdm=False)
        assert [o.token_ids for o in group] == [o.token_ids for o in outs[i:i + 2]]


def test_kv_exhaustion_preempts_and_recomputes_without_changing_outputs(ckpt_a):
    prompts = random_prompts(vocab_of(ckpt_a), [20, 25, 18, 22], seed=9)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5)
    ref = LLM(ckpt_a, verbose=False).generate(prompts, params, use_tqdm=False)
    tight = LLM(ckpt_a, kv_cache_tokens=60, max_model_len=50, chunk_size=32, verbose=False)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert sum(o.num_preemptions for o in outs) > 0
    assert _free_everything(tight.engine)


def test_a_prompt_that_fills_the_pool_is_not_preempted_over_and_over(ckpt_a):
    """A prompt near the KV pool's size among short requests, the prefix cache off: it is admitted once its whole
    prefill fits beside what the running requests still need, so it is not preempted before its last chunk and
    computed again (13 times here before: every preemption wasted its chunks so far); the outputs are unchanged."""
    vocab = vocab_of(ckpt_a)
    tight = LLM(ckpt_a, kv_cache_tokens=400, max_num_seqs=6, chunk_size=64, enable_prefix_caching=False,
                verbose=False)
    long = random_prompts(vocab, [tight.engine.max_model_len - 10], seed=3)[0]
    prompts = random_prompts(vocab, [30, 40, 25], seed=4) + [long] + random_prompts(vocab, [35, 20, 30, 45], seed=5)
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=i) for i in range(8)]
    params[3] = SamplingParams(max_tokens=8, temperature=0)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert outs[3].num_preemptions == 0 and sum(o.num_preemptions for o in outs) <= 2
    ref = LLM(ckpt_a, enable_prefix_caching=False, verbose=False).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert _free_everything(tight.engine)


def test_abort_frees_slots_and_others_carry_on(ckpt_a):
    prompts = random_prompts(vocab_of(ckpt_a), [10, 15, 8], seed=10)
    ref = _run_all(Engine(ckpt_a, engine_config=EngineConfig(verbose=False)), [prompts[0], prompts[2]], GREEDY)
    eng = Engine(ckpt_a, engine_config=EngineConfig(verbose=False))
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    eng.step()
    eng.step()
    assert eng.abort(rids[1]) and not eng.abort(rids[1])
    waiting = eng.add_request(prompts[1], GREEDY)
    assert eng.abort(waiting)  # aborting a queued request works too
    while eng.has_unfinished():
        eng.step()
    aborted = eng.pop_finished(rids[1])
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) <= 2
    assert [eng.pop_finished(rids[0]).token_ids, eng.pop_finished(rids[2]).token_ids] == [r.token_ids for r in ref]
    assert _free_everything(eng)


def test_stop_token_ids_eos_and_context_limit(ckpt_a):
    prompt = random_prompts(vocab_of(ckpt_a), [6], seed=11)[0]
    eng = Engine(ckpt_a, engine_config=EngineConfig(verbose=False))
    free_run = _run_all(eng, [prompt], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    out = _run_all(eng, [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == free_run[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    eng.eos_ids = {stop_tok}
    out = _run_all(eng, [prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    # the end-of-sequence token ends it with no stop_reason (vLLM's rule: only a stop string or stop token id)
    assert out.token_ids == free_run[:first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = _run_all(eng, [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == free_run
    short = Engine(ckpt_a, engine_config=EngineConfig(verbose=False, max_model_len=10))
    out = _run_all(short, [prompt], SamplingParams(max_tokens=100, temperature=0))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 10


def test_stop_strings_and_text_with_the_default_model():
    llm = LLM(verbose=False)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate("Hello", params, use_tqdm=False)[0]
    assert full.text == llm.tokenizer.decode(full.token_ids) and len(full.token_ids) == 30
    visible = [c for c in full.text[3:] if c.isprintable() and c != "\ufffd"]
    if not visible:
        pytest.skip("random model produced no printable character to stop on")
    stop = visible[0]
    cut = full.text.index(stop)
    out = llm.generate("Hello", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    # min_tokens: no stop string is matched within the first min_tokens tokens; the first match after them ends it
    n = len(out.token_ids) + 1  # the stop string was completed by token n - 1 (counting from 1): now past it
    at = len(llm.tokenizer.decode(full.token_ids[:n]))
    later = full.text.find(stop, max(0, at - len(stop) + 1))
    out = llm.generate("Hello", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                               min_tokens=n), use_tqdm=False)[0]
    assert len(out.token_ids) > n or out.finish_reason == "length" and len(out.token_ids) == 30
    assert out.text == (full.text[:later] if later >= 0 else full.text)


def test_seeds_reproducible_and_independent_of_batch(ckpt_a):
    prompts = random_prompts(vocab_of(ckpt_a), [7, 19, 4], seed=12)
    llm = LLM(ckpt_a, verbose=False)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=42)
    a = llm.generate(prompts[0], seeded, use_tqdm=False)[0].token_ids
    b = llm.generate(prompts, [seeded, SamplingParams(max_tokens=5, temperature=1.0),
                               SamplingParams(max_tokens=9, temperature=0)], use_tqdm=False)[0].token_ids
    assert a == b
    other = llm.generate(prompts[0], SamplingParams(max_tokens=12, temperature=1.0, seed=43), use_tqdm=False)
    assert other[0].token_ids != a


def test_scheduled_kv_runs_become_one_triple_per_position():
    """The scheduler hands the worker its new KV positions as runs (request slot, first position, locations); the
    worker's one copy to the device carries them as (slot, position, location) triples, in run order."""
    import torch

    from hylo.core import ForwardMode
    from hylo.engine.plan import ScheduledBatch

    plan = ScheduledBatch(reqs=[], extend_lens=[], prefix_lens=[], sample=[], mode=ForwardMode.EXTEND)
    assert plan.kv_triples() is None
    plan.kv_starts = [(3, 10), (1, 0), (7, 5)]
    plan.kv_locs = [torch.tensor([50, 51, 52]), torch.tensor([9]), torch.tensor([20, 21])]
    assert plan.kv_triples().tolist() == [[3, 3, 3, 1, 7, 7], [10, 11, 12, 0, 5, 6], [50, 51, 52, 9, 20, 21]]


@pytest.mark.parametrize("runs", [True, False])
def test_extend_pack_expands_to_the_rows_tokens_positions_and_locations(runs):
    """An EXTEND step's one host-to-device tensor (engine/extend.py), expanded by the torch reference: the new KV
    runs land in req_to_token, and every token gets its row's position, location, and input id (the host's prompt
    tokens, or a decoding row's newest token from the device table); the sampling rows and the sampling
    parameters of the requests starting their prefill travel with it. Without ``runs``, no location is new."""
    from extend_cases import extend_case

    from hylo.engine.extend import ExtendPack, expand

    plan, r2t, last = extend_case(runs=runs)
    register = [r for r, p in zip(plan.reqs, plan.prefix_lens) if p == 0]
    pack = ExtendPack.build(plan, register, vocab_size=500)
    expected = r2t.clone()
    for (slot, first), locs in zip(plan.kv_starts, plan.kv_locs):
        expected[slot, first:first + locs.numel()] = locs.long()
    ids, pos, loc, rows, lens = expand(pack, pack.meta.clone(), r2t, last)
    assert torch.equal(r2t, expected)
    want_ids, want_pos, want_rows = [], [], []
    for i, (r, n, p, d) in enumerate(zip(plan.reqs, plan.extend_lens, plan.prefix_lens, plan.from_device)):
        want_ids += [int(last[r.req_slot])] if d else r.prompt_ids[p:p + n]
        want_pos += list(range(p, p + n))
        want_rows += [i] * n
    assert ids.tolist() == want_ids and pos.tolist() == want_pos and rows.tolist() == want_rows
    slots_of = torch.tensor([plan.reqs[i].req_slot for i in want_rows])
    assert torch.equal(loc, expected[slots_of, pos])
    assert lens.tolist() == [p + n for p, n in zip(plan.prefix_lens, plan.extend_lens)]
    v = pack.views(pack.meta)
    ends = torch.tensor(plan.extend_lens).cumsum(0) - 1
    assert v["sample_rows"].tolist() == [i for i, s in enumerate(plan.sample) if s] == [0, 1, 2, 3]
    assert v["sample_idx"].tolist() == ends[v["sample_rows"]].tolist()
    reg = plan.reqs[3]  # top_k 0: the vocabulary; then seed, prompt length, max_tokens, stop on EOS
    assert v["reg_slots"].tolist() == [3] and v["reg_ints"].tolist() == [500, 100, 40, reg.params.max_tokens,
                                                                          int(not reg.params.ignore_eos)]
    assert v["reg_floats"].view(torch.float32).tolist() == [0.0, pytest.approx(0.9)]
    assert v["req"].tolist() == [3, 5, 1, 7] and v["state"].tolist() == [2, -1, 0, 4]
