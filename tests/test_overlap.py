"""The overlap loop: the same outputs as the plain loop, no blocking read in the steady state, and no use of a
freed slot or KV location under thousands of steps of random arrivals, aborts and finishes."""

import pytest

from hylo import SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.speculative.setup import SpecSetup

from helpers import all_freed, check_against, drive, random_prompts, traffic, vocab_of


def _engine(path, spec=None, **kw):
    ec = EngineConfig(verbose=False, **({"speculative": spec} if spec else {}), **kw)
    return Engine(path, engine_config=ec, spec_setup=SpecSetup(spec) if spec else None)


def _model(request, model):
    """A checkpoint path by model: Qwen3-Next (GDN, with an MTP head), Nemotron-H (Mamba2) or Nemotron 3 with MTP
    layers (Mamba2, MoE blocks, the Nemotron MTP head)."""
    if model == "qwen3_next":
        return request.getfixturevalue("ckpt_a_mtp")
    return request.getfixturevalue("nemotron_mtp" if model == "nemotron3_mtp" else "nemotron_h")[0]


@pytest.mark.parametrize("model,spec,policy", [("qwen3_next", None, None), ("qwen3_next", "mtp", "fixed"),
                                               ("qwen3_next", "mtp", "adaptive"), ("qwen3_next", "ngram", "adaptive"),
                                               ("nemotron_h", None, None), ("nemotron_h", "ngram", "adaptive"),
                                               ("nemotron3_mtp", "mtp", "adaptive")])
def test_overlap_on_and_off_give_identical_outputs(request, model, spec, policy):
    """The adaptive policy's choices follow measured step times, so its verify and plain steps differ from run to
    run; the tokens may not."""
    ckpt_a_mtp = _model(request, model)
    vocab = vocab_of(ckpt_a_mtp)
    work = traffic(vocab, 14, seed=5 if model == "qwen3_next" else 7)  # a seed whose traffic aborts some requests
    opts = dict(chunk_size=8, max_num_seqs=4, **({"spec_policy": policy} if policy else {}))
    off, _ = drive(_engine(ckpt_a_mtp, spec, overlap=False, **opts), work)
    on, _ = drive(_engine(ckpt_a_mtp, spec, overlap=True, **opts), work)
    # without aborts (the references for the aborted requests' prefixes)
    clean = [(p, params, at, None) for p, params, at, _ in work]
    ref, _ = drive(_engine(ckpt_a_mtp, spec, overlap=False, **opts), clean)
    check_against(off, ref, work)
    assert check_against(on, ref, work) > 0
    for i in range(len(work)):
        if on[i].finish_reason != "abort" and off[i].finish_reason != "abort":
            assert on[i].token_ids == off[i].token_ids
            if policy == "fixed":  # the same verify steps, so the same acceptance
                assert on[i].spec.as_dict() == off[i].spec.as_dict()


@pytest.mark.parametrize("model,spec", [("qwen3_next", None), ("qwen3_next", "mtp"), ("qwen3_next", "ngram"),
                                        ("nemotron_h", "ngram")])
def test_no_blocking_read_in_the_steady_state(request, model, spec):
    """Overlap on: a step that launched work never waits for the device with nothing queued behind the wait.
    Overlap off: every step waits once, with nothing queued."""
    ckpt_a_mtp = _model(request, model)
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


@pytest.mark.parametrize("model,spec", [("qwen3_next", None), ("qwen3_next", "mtp"), ("nemotron_h", "ngram"),
                                        ("nemotron3_mtp", "mtp")])
def test_stress_random_traffic_never_reads_freed_memory(request, model, spec):
    """Qwen3-Next (GDN, plain and MTP), Nemotron-H (Mamba2, n-gram) and Nemotron 3 (Mamba2 and MoE, its MTP
    head)."""
    ckpt_b_mtp = (request.getfixturevalue("ckpt_b_mtp") if model == "qwen3_next"
                  else _model(request, model))
    vocab = vocab_of(ckpt_b_mtp)
    # shared prefixes: prefix-cache hits, snapshots and evictions under the same poisoned frees
    work = traffic(vocab, 450, seed=11 if spec else 12, max_steps_between=5, abort_frac=0.25, max_tokens=(1, 30),
                   shared=4)
    # a small KV pool: admissions wait and running requests get preempted
    opts = dict(chunk_size=16, max_num_seqs=6, kv_cache_tokens=160)
    eng = _engine(ckpt_b_mtp, spec, overlap=True, **opts)
    counts = _poison_on_free(eng)
    outs, steps = drive(eng, work)
    assert steps >= 1000
    clean = [(p, params, at, None) for p, params, at, _ in work]
    ref, _ = drive(_engine(ckpt_b_mtp, spec, overlap=False, chunk_size=16, max_num_seqs=8,
                           enable_prefix_caching=False), clean)
    assert check_against(outs, ref, work) > 20
    assert sum(o.num_preemptions for o in outs.values()) > 0
    stats = eng.prefix_cache.stats
    assert stats.hit_tokens > 200 and stats.kv_evicted > 0 and stats.snapshots_evicted > 0, stats
    # everything went back, each exactly once (the free lists assert against double frees), the prefix cache's
    # share once it is dropped
    assert all_freed(eng)
    # one release per admission (a state slot also per dropped snapshot); every request that produced a token was
    # admitted at least once
    assert counts["state"] >= counts["req"] >= sum(1 for o in outs.values() if o.token_ids)
