"""One request's failure never stops the engine: out-of-range numbers are refused at the edge, and an internal error
raised while serving one request fails that request (a 500 error object on the server) while the others go on."""

import pytest

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine

from helpers import all_freed

MODEL = "hylo-default-random"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _run(eng, prompts, params=GREEDY):
    rids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [eng.pop_finished(r) for r in rids]


@pytest.fixture(scope="module")
def reference():
    eng = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False))
    return {tuple(o.prompt_token_ids): o.token_ids for o in _run(eng, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])}


def test_seed_outside_int64_is_a_clear_error():
    for seed in (1 << 63, -(1 << 63) - 1, 10 ** 30):
        with pytest.raises(ValueError, match="seed must be between"):
            SamplingParams(seed=seed)
    SamplingParams(seed=(1 << 63) - 1)
    SamplingParams(seed=-(1 << 63))


@pytest.mark.parametrize("overlap", [True, False])
def test_host_side_failure_of_one_request_spares_the_others(reference, overlap, capsys):
    eng = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False, overlap=overlap))
    append = eng._append_token

    def flaky(req, token):  # a bug that hits one request only, on its third token
        if req.prompt_ids == [8, 9] and len(req.output_ids) == 2:
            raise OverflowError("injected")
        return append(req, token)

    eng._append_token = flaky
    outs = _run(eng, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    by_prompt = {tuple(o.prompt_token_ids): o for o in outs}
    bad = by_prompt[(8, 9)]
    assert bad.finish_reason == "abort" and "OverflowError" in bad.error
    for p in ((5, 6, 7), (10, 11, 12, 13)):
        assert by_prompt[p].error is None and by_prompt[p].token_ids == reference[p]
    assert "OverflowError: injected" in capsys.readouterr().err  # the engine's own fault: logged with its traceback
    # everything freed, and the engine still serves
    assert all_freed(eng)
    eng._append_token = append
    assert _run(eng, [[8, 9]])[0].token_ids == reference[(8, 9)]


def test_failed_launch_fails_that_step_only(reference):
    """A step whose launch raises fails its own rows; a request that was waiting meanwhile is served exactly."""
    eng = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False, chunk_size=3, max_num_seqs=2))
    run = eng.worker.run
    seen = []

    def failing_once(sched):
        seen.append([tuple(r.prompt_ids) for r in sched.reqs])
        if len(seen) == 2:
            raise RuntimeError("injected launch failure")
        return run(sched)

    eng.worker.run = failing_once
    outs = {tuple(o.prompt_token_ids): o for o in _run(eng, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])}
    assert sorted(seen[1]) == [(5, 6, 7), (8, 9)]  # the failing step held the first two requests
    for p in seen[1]:
        assert outs[p].finish_reason == "abort" and "RuntimeError" in outs[p].error
    assert outs[(10, 11, 12, 13)].error is None
    assert outs[(10, 11, 12, 13)].token_ids == reference[(10, 11, 12, 13)]
    assert all_freed(eng)
    assert _run(eng, [[5, 6, 7]])[0].token_ids == reference[(5, 6, 7)]


@pytest.mark.parametrize("where", ["step", "row"])
def test_failed_read_fails_that_step_only(reference, where, monkeypatch, capsys):
    """An internal error while a step's results are read (``step``: before any row, ``row``: one row's log
    probabilities) fails the rows not yet read, or that row alone, as 500s, logged once; the engine goes on and a
    request waiting meanwhile is served exactly (the error used to escape ``step()`` and stop the engine)."""
    import hylo.engine.engine as engine_module

    eng = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False, chunk_size=8, max_num_seqs=2))
    calls = [0]

    def failing(*args):
        calls[0] += 1
        raise RuntimeError("injected read failure")
    monkeypatch.setattr(engine_module, "apply_prompt_logprobs" if where == "step" else "unpack_logprobs", failing)
    first = (SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0) if where == "step"
             else SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1))
    params = [first, GREEDY, GREEDY]
    rids = [eng.add_request(p, sp) for p, sp in zip([[5, 6, 7], [8, 9], [10, 11, 12, 13]], params)]
    while eng.has_unfinished():
        eng.step()
    outs = {tuple(o.prompt_token_ids): o for o in map(eng.pop_finished, rids)}
    assert calls[0] == 1
    failed = [p for p, o in outs.items() if o.error is not None]
    assert (5, 6, 7) in failed and all("internal error" in outs[p].error for p in failed)
    assert sorted(failed) == ([(5, 6, 7)] if where == "row" else [(5, 6, 7), (8, 9)])  # (the first step's two)
    for p, o in outs.items():
        if p not in failed:
            assert o.token_ids == reference[p]
    assert capsys.readouterr().err.count("RuntimeError: injected read failure") == 1  # one traceback a step
    monkeypatch.undo()
    assert all_freed(eng)
    assert _run(eng, [[5, 6, 7]])[0].token_ids == reference[(5, 6, 7)]


def test_offline_generate_raises_on_an_internal_error():
    llm = LLM(MODEL, device="cpu", verbose=False)
    llm.engine._append_token = lambda req, token: 1 / 0
    with pytest.raises(RuntimeError, match="prompt 0: internal error.*ZeroDivisionError"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.caches.req_slots.num_used == 0


def _client(engine):
    from fastapi.testclient import TestClient

    from hylo.server.app import create_app

    return TestClient(create_app(engine))


def test_server_refuses_out_of_range_integers_and_keeps_serving():
    eng = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    with _client(eng) as http:
        for field, value in [("seed", 1 << 63), ("seed", -(1 << 63) - 1), ("top_k", 1 << 64), ("n", 10 ** 20),
                             ("max_tokens", 1 << 70), ("stop_token_ids", [1 << 63]), ("top_logprobs", 21)]:
            r = http.post("/v1/chat/completions", json={**chat, field: value})
            assert r.status_code == 400, (field, r.text)
            err = r.json()["error"]
            assert err["param"] == field and field in err["message"], err
        r = http.post("/v1/chat/completions", json={**chat, "stop_token_ids": [10 ** 6]})
        assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
        # the largest seed works, and n > 1 wraps its choices' seeds inside the int64 range
        r = http.post("/v1/chat/completions", json={**chat, "seed": (1 << 63) - 1, "n": 2, "temperature": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True})
        assert r.status_code == 200


def test_server_answers_500_for_the_failed_request_only(reference):
    eng = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False))
    append = eng._append_token

    def flaky(req, token):
        if req.prompt_ids == [8, 9]:
            raise OverflowError("injected")
        return append(req, token)

    eng._append_token = flaky
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with _client(eng) as http:
        r = http.post("/v1/completions", json={**body, "prompt": [8, 9]})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "internal error" in err["message"]
        assert "Traceback" not in r.text
        with http.stream("POST", "/v1/completions", json={**body, "prompt": [8, 9], "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert any('"server_error"' in ln for ln in lines) and lines[-1] == "data: [DONE]"
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={**body, "prompt": [5, 6, 7]})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == eng.tokenizer.decode(reference[(5, 6, 7)])


def test_a_failed_request_leaves_nothing_behind():
    """A failed request leaves no trace in the device tables that a later request with the same slot reads."""
    eng = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False, max_num_seqs=1))
    eng._append_token, ok = (lambda req, token: (_ for _ in ()).throw(ValueError("x"))), eng._append_token
    assert _run(eng, [[1, 2]])[0].error
    eng._append_token = ok
    a = _run(eng, [[5, 6, 7]], SamplingParams(max_tokens=5, temperature=1.0, seed=3))[0].token_ids
    fresh = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False, max_num_seqs=1))
    assert a == _run(fresh, [[5, 6, 7]], SamplingParams(max_tokens=5, temperature=1.0, seed=3))[0].token_ids


def test_dropping_an_llm_gives_its_memory_back():
    """``del llm`` (or ``close()``, or the end of a ``with`` block) frees the engine's caches at once, without
    waiting for a garbage collection (on a GPU the graphs' reference cycles held them)."""
    import gc
    import weakref

    gc.disable()  # nothing may rely on the collector
    try:
        llm = LLM(MODEL, device="cpu", verbose=False)
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        kv = weakref.ref(llm.engine.caches.kv_pool.k)
        del llm
        assert kv() is None
        with LLM(MODEL, device="cpu", verbose=False) as llm:
            state = weakref.ref(llm.engine.caches.state_pool.recurrent)
        assert state() is None
        llm.close()  # twice is fine
    finally:
        gc.enable()


def test_an_interrupt_in_a_grammar_rows_early_read_leaves_nothing_behind(monkeypatch):
    """A grammar row's step reads the step in flight before it launches (its mask needs that token): Ctrl-C while
    waiting there raises, every slot comes back, and the cut step is not read a second time by the next call
    (which would end its rows twice: in-flight counts below zero, slots never freed)."""
    from hylo.constrain.spec import Constraint
    from hylo.engine.host_reads import PendingRead

    llm = LLM(None, device="cpu", verbose=False, max_num_seqs=2)
    eng = llm.engine
    grammar = SamplingParams(max_tokens=12, temperature=0, constraint=Constraint.grammar('root ::= "x = " [0-9]+'))
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(["\n", "def f(x):"], [grammar, plain], use_tqdm=False)
    wait, step, launch = PendingRead.wait, type(eng).step, type(eng)._launch
    phase, cuts, syncs = [None], [0], eng.host_syncs

    def marked_step(self):  # a read made in step() before its launch is the early one
        phase[0] = "early"
        try:
            return step(self)
        finally:
            phase[0] = None

    def marked_launch(self):
        phase[0] = "launch"
        return launch(self)

    def cut(self):
        if phase[0] == "early" and eng.host_syncs >= syncs + 2:
            cuts[0] += 1
            raise KeyboardInterrupt
        return wait(self)
    monkeypatch.setattr(type(eng), "step", marked_step)
    monkeypatch.setattr(type(eng), "_launch", marked_launch)
    monkeypatch.setattr(PendingRead, "wait", cut)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["\n", "def f(x):"], [grammar, plain], use_tqdm=False)
    monkeypatch.undo()
    assert cuts[0] == 1 and not eng.has_unfinished()
    assert all(r.inflight == 0 for r in eng._reqs.values())
    again = llm.generate(["\n", "def f(x):"], [grammar, plain], use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in alone]
    assert all_freed(eng)


@pytest.mark.parametrize("where", ["reading", "forward"])
def test_an_interrupt_mid_step_leaves_nothing_behind(where, monkeypatch):
    """Ctrl-C while generate() waits for a step's results, or inside a step's forward pass (after some layers
    updated the states in place): the call raises KeyboardInterrupt, every slot comes back, the prefix cache keeps
    nothing the cut step half-wrote (the next turn's output is the cache-off output), and the LLM serves on."""
    from hylo.engine.host_reads import PendingRead

    llm = LLM(None, device="cpu", verbose=False, max_num_seqs=2)
    eng = llm.engine
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm.generate("def f(x):", p, use_tqdm=False)[0]
    turn = first.prompt_token_ids + first.token_ids
    calls = [0]
    if where == "reading":
        wait = PendingRead.wait

        def cut(self):
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return wait(self)
        monkeypatch.setattr(PendingRead, "wait", cut)
    else:
        layer = eng.model.layers[3]
        forward = type(layer).forward

        def cut(self, *args, **kwargs):
            if self is layer:
                calls[0] += 1
                if calls[0] == 4:  # a decode step, layers 0-2 written
                    raise KeyboardInterrupt
            return forward(self, *args, **kwargs)
        monkeypatch.setattr(type(layer), "forward", cut)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([turn, "import os"], p, use_tqdm=False)
    monkeypatch.undo()
    assert calls[0] >= 3
    nxt = turn + [5, 6, 7]
    got = llm.generate(nxt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0]
    cold = LLM(None, device="cpu", verbose=False, enable_prefix_caching=False).generate(
        nxt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    assert got.token_ids == cold.token_ids
    assert abs(got.logprobs[0].logprob - cold.logprobs[0].logprob) < 1e-4
    assert not eng.has_unfinished() and all_freed(eng)
