"""The overlap loop: the same outputs as the plain loop, no blocking read in the steady state, and no use of a
freed slot or KV location under thousands of steps of random arrivals, aborts and finishes."""

import random

import pytest

from hylo import SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.spec.setup import SpecSetup

from helpers import random_prompts, vocab_of


def _engine(path, spec=None, **kw):
    ec = EngineConfig(verbose=False, **({"speculative": spec} if spec else {}), **kw)
    return Engine(path, engine_config=ec, spec_setup=SpecSetup(spec) if spec else None)


def _workload(vocab, n, seed, max_steps_between=3, abort_frac=0.2, max_tokens=(1, 24)):
    """n requests: prompt, params, arrival step, and an abort step (or None)."""
    rng = random.Random(seed)
    prompts = random_prompts(vocab, [rng.randint(1, 40) for _ in range(n)], seed=seed)
    step, reqs = 0, []
    for i, p in enumerate(prompts):
        step += rng.randint(0, max_steps_between)
        params = SamplingParams(max_tokens=rng.randint(*max_tokens), temperature=0,
                                stop_token_ids=[rng.randrange(vocab)] if rng.random() < 0.3 else None)
        abort = step + rng.randint(0, 12) if rng.random() < abort_frac else None
        reqs.append((p, params, step, abort))
    return reqs


def _drive(eng, workload, on_step=None):
    """Run a workload (arrivals and aborts keyed by step number); returns every request's output."""
    arrivals, aborts = {}, {}
    for i, (_, _, at, ab) in enumerate(workload):
        arrivals.setdefault(at, []).append(i)
        if ab is not None:
            aborts.setdefault(ab, []).append(i)
    last = max([at for _, _, at, _ in workload] + [ab for *_, ab in workload if ab is not None])
    rids, step = {}, 0
    while step <= last or eng.has_unfinished():
        for i in arrivals.get(step, []):
            p, params, _, _ = workload[i]
            rids[i] = eng.add_request(p, params, request_id=f"r{i}")
        for i in aborts.get(step, []):
            eng.abort(rids[i])
        eng.step()
        if on_step is not None:
            on_step(step)
        step += 1
    return {i: eng.pop_finished(rid) for i, rid in rids.items()}, step


def _check_against(outs, ref, workload):
    """Requests that were not aborted match the reference exactly; aborted ones produced a prefix of it."""
    aborted = 0
    for i, (_, _, _, ab) in enumerate(workload):
        o, r = outs[i], ref[i]
        if o.finish_reason == "abort":
            aborted += 1
            assert o.token_ids == r.token_ids[:len(o.token_ids)], i
        else:
            assert (o.token_ids, o.finish_reason) == (r.token_ids, r.finish_reason), i
    return aborted


@pytest.mark.parametrize("spec", [None, "mtp", "ngram"])
def test_overlap_on_and_off_give_identical_outputs(ckpt_a_mtp, spec):
    vocab = vocab_of(ckpt_a_mtp)
    work = _workload(vocab, 14, seed=5)
    opts = dict(chunk_size=8, max_num_seqs=4)
    off, _ = _drive(_engine(ckpt_a_mtp, spec, overlap=False, **opts), work)
    on, _ = _drive(_engine(ckpt_a_mtp, spec, overlap=True, **opts), work)
    # without aborts (the references for the aborted requests' prefixes)
    clean = [(p, params, at, None) for p, params, at, _ in work]
    ref, _ = _drive(_engine(ckpt_a_mtp, spec, overlap=False, **opts), clean)
    _check_against(off, ref, work)
    assert _check_against(on, ref, work) > 0
    for i in range(len(work)):
        if on[i].finish_reason != "abort" and off[i].finish_reason != "abort":
            assert on[i].token_ids == off[i].token_ids
            if spec:  # the same verify steps, so the same acceptance
                assert on[i].spec.as_dict() == off[i].spec.as_dict()


@pytest.mark.parametrize("spec", [None, "mtp", "ngram"])
def test_no_blocking_read_in_the_steady_state(ckpt_a_mtp, spec):
    """Overlap on: a step that launched work never waits for the device with nothing queued behind the wait.
    Overlap off: every step waits once, with nothing queued."""
    vocab = vocab_of(ckpt_a_mtp)
    prompts = random_prompts(vocab, [5, 20, 11], seed=13)
    for overlap in (True, False):
        eng = _engine(ckpt_a_mtp, spec, overlap=overlap, chunk_size=8)
        for p in prompts:
            eng.add_request(p, SamplingParams(max_tokens=12, temperature=0))
        steady = 0
        while eng.has_unfinished():
            blocking, overlapped = eng.host_reads.blocking, eng.host_reads.overlapped
            had_inflight = eng._inflight is not None
            eng.step()
            if overlap:
                launched = eng._inflight is not None
                if launched and had_inflight:  # the steady state: launch N+1, then read N behind it
                    steady += 1
                    assert eng.host_reads.blocking == blocking
                    assert eng.host_reads.overlapped == overlapped + 1
                elif not launched:  # nothing left to launch: the last read has nothing behind it
                    assert eng.host_reads.blocking <= blocking + had_inflight
            else:
                assert eng.host_reads.blocking == blocking + 1 and eng.host_reads.overlapped == 0
        if overlap:
            assert steady >= 6
            assert eng.host_reads.blocking == 1  # the final drain only


def _poison_on_free(eng):
    """Fill freed KV locations and state slots with NaN, and a freed request slot's device tables (newest token,
    length) with out-of-range values, at the moment they return to the free lists: any later read of them shows in
    the outputs (or raises). (``req_to_token`` rows are left alone: the reference attention gathers whole rows and
    masks past each length, a read of nothing.)"""
    c = eng.caches
    kv_free, st_free, rq_free = c.kv_pool.free, c.state_pool.free, c.req_slots.free
    counts = {"kv": 0, "state": 0, "req": 0}

    def kv(locs):
        c.kv_pool.k[:, locs] = float("nan")
        c.kv_pool.v[:, locs] = float("nan")
        counts["kv"] += len(locs)
        kv_free(locs)

    def state(slot):
        c.state_pool.conv[:, slot] = float("nan")
        c.state_pool.recurrent[:, slot] = float("nan")
        counts["state"] += 1
        st_free(slot)

    def req(slot):
        c.req_slots.seq_len[slot] = -(1 << 40)
        c.req_slots.last_token[slot] = -(1 << 40)
        counts["req"] += 1
        rq_free(slot)

    c.kv_pool.free, c.state_pool.free, c.req_slots.free = kv, state, req
    return counts


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_stress_random_traffic_never_reads_freed_memory(ckpt_b_mtp, spec):
    vocab = vocab_of(ckpt_b_mtp)
    work = _workload(vocab, 450, seed=11 if spec else 12, max_steps_between=5, abort_frac=0.25, max_tokens=(1, 30))
    # a small KV pool: admissions wait and running requests get preempted
    opts = dict(chunk_size=16, max_num_seqs=6, kv_cache_tokens=160)
    eng = _engine(ckpt_b_mtp, spec, overlap=True, **opts)
    counts = _poison_on_free(eng)
    outs, steps = _drive(eng, work)
    assert steps >= 1000
    clean = [(p, params, at, None) for p, params, at, _ in work]
    ref, _ = _drive(_engine(ckpt_b_mtp, spec, overlap=False, chunk_size=16, max_num_seqs=8), clean)
    assert _check_against(outs, ref, work) > 20
    assert sum(o.num_preemptions for o in outs.values()) > 0
    c = eng.caches
    # everything went back, each exactly once (the free lists assert against double frees)
    assert c.req_slots.num_free == c.req_slots.max_num_seqs
    assert c.state_pool.num_free == c.state_pool.num_slots
    assert c.kv_pool.num_free == c.kv_pool.num_tokens
    # one release per admission; every request that produced a token was admitted at least once
    assert counts["req"] == counts["state"] >= sum(1 for o in outs.values() if o.token_ids)
