"""The adaptive speculation policy (engine/spec_policy.py): when a step verifies drafts and when it decodes plainly,
and that everything stays lossless while it switches."""

import pytest
import torch

from hylo import SamplingParams
from hylo.config import EngineConfig
from hylo.core import Req, SpecStats
from hylo.engine.engine import Engine
from hylo.engine.spec_policy import BASE_INTERVAL, MAX_INTERVAL, PRIOR_RATIO, DraftPolicy
from hylo.speculative.ngram import NgramDrafter
from hylo.speculative.setup import SpecSetup

from helpers import random_prompts, vocab_of


def _req(est=None, has_drafts=True):
    r = Req(rid="r", prompt_ids=[1], params=SamplingParams(), seed=0, spec=SpecStats(accept_estimate=est))
    r.has_drafts = has_drafts
    return r


def _policy(ratio=2.0, bs=1):
    p = DraftPolicy(3)
    p.observe_step(False, bs, 1.0)
    p.observe_step(True, bs, ratio)
    return p


def test_verify_only_where_the_expected_yield_beats_the_cost_ratio():
    p = _policy(2.0)
    assert p.choose([_req(2.0)]).verify  # 3 tokens a step for twice the cost
    assert not p.choose([_req(0.9)]).verify  # 1.9 for 2.0
    # a batch: the mean yield counts (one good row carries a poor one)
    assert p.choose([_req(3.0), _req(0.2)]).verify  # 2.6 tokens a row
    assert not p.choose([_req(1.5), _req(0.2)]).verify  # 1.85: no costs at batch 2 yet, batch 1's 2.0 stands
    p.observe_step(False, 2, 1.0)
    p.observe_step(True, 2, 1.5)
    assert p.choose([_req(1.5), _req(0.2)]).verify
    # before any verify, a request is assumed to accept k / 2; before any measurement the ratio is the prior
    fresh = DraftPolicy(3)
    assert fresh.cost_ratio(8) == PRIOR_RATIO and fresh.choose([_req()]).verify == (1 + 1.5 > PRIOR_RATIO * 1.03)
    # fixed: every step verifies
    assert DraftPolicy(3, adaptive=False).choose([_req(0.0)]).verify


def test_cost_ratio_follows_measurements_at_the_nearest_batch_size():
    p = _policy(2.0, bs=1)
    p.observe_step(False, 64, 10.0)
    p.observe_step(True, 64, 15.0)
    assert p.cost_ratio(1) == pytest.approx(2.0) and p.cost_ratio(48) == pytest.approx(1.5)
    assert p.cost_ratio(4) == pytest.approx(2.0)
    p.observe_step(True, 64, 25.0)  # a running estimate: the newest measurement moves it part of the way
    assert 1.5 < p.cost_ratio(64) < 2.5


def test_rows_that_stop_accepting_fall_back_and_are_probed_ever_less_often():
    p = _policy(2.0)
    r = _req(3.0)
    assert p.choose([r]).verify
    for _ in range(3):
        p.observe_row(r, 0)
    assert r.spec.accept_estimate < 1.1 and not p.choose([r]).verify  # three misses: plain
    plain_since, gaps = 0, []
    for _ in range(BASE_INTERVAL * 64):
        c = p.choose([r])
        if c.verify:
            assert c.probe
            gaps.append(plain_since)
            plain_since = 0
            p.observe_row(r, 0)
            p.observe_verify([0])
        else:
            plain_since += 1
    # each probe waits twice as long as the one before, up to the cap
    assert gaps[:4] == [BASE_INTERVAL - 1, 2 * BASE_INTERVAL, 4 * BASE_INTERVAL, 8 * BASE_INTERVAL]
    assert max(gaps) <= MAX_INTERVAL
    # the step before a probe drafts (the probe verifies those drafts); other plain steps do not
    p2 = _policy(2.0)
    choices = [p2.choose([_req(0.0)]) for _ in range(BASE_INTERVAL + 1)]
    assert [c.draft_after for c in choices[:-1]] == [False] * (BASE_INTERVAL - 1) + [True]
    assert choices[-1].verify and choices[-1].probe


def test_a_probe_that_pays_brings_speculation_back():
    p = _policy(2.0)
    r = _req(0.0)
    while not p.choose([r]).verify:
        pass
    p.interval = MAX_INTERVAL  # as after many failed probes
    p.observe_row(r, 3)
    p.observe_verify([3])  # 4 tokens from that step: speculation pays again
    assert p.interval == BASE_INTERVAL
    p.observe_row(r, 3)
    assert p.choose([r]).verify


def test_a_row_without_drafts_decodes_plainly_once_drafting_for_the_next_step():
    p = _policy(2.0)
    c = p.choose([_req(3.0), _req(3.0, has_drafts=False)])
    assert not c.verify and c.draft_after


def test_ngram_rows_without_a_match_draft_nothing():
    d = NgramDrafter(3, max_num_seqs=2, max_context=16, device=torch.device("cpu"))
    d.table[1, :6] = torch.tensor([5, 6, 7, 5, 6, 7])  # "5 6" recurs: the lookup proposes what followed it
    d.table[2, :4] = torch.tensor([1, 2, 3, 4])  # nothing recurs
    d.lens[1:3] = torch.tensor([6, 4])
    d._propose_for(torch.tensor([1, 2]), 16)
    assert d.draft_limit(torch.tensor([1, 2])).tolist() == [3, 0]
    assert d.drafts[1].tolist() == [5, 6, 7]


def _engine(path, method, **kw):
    ec = EngineConfig(verbose=False, speculative=method, num_speculative_tokens=3, **kw)
    return Engine(path, engine_config=ec, spec_setup=SpecSetup(method))


def _greedy(eng, prompt, n):
    rid = eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=0))
    while eng.has_unfinished():
        eng.step()
    return eng.pop_finished(rid)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_acceptance_that_collapses_falls_back_to_plain_and_recovers(ckpt_a_mtp, method):
    """Drafts right for the first 20 tokens, wrong for the next 30, right again after: the request verifies, falls
    back to plain decoding within a few steps of the collapse (probing now and then), and verifies again once its
    drafts are right, with the same greedy tokens as plain decoding throughout. The step costs are fixed (verify
    twice a plain step) so the choices do not depend on this machine's timing."""
    prompt = random_prompts(vocab_of(ckpt_a_mtp), [9], seed=21)[0]
    n = 140
    plain = _greedy(Engine(ckpt_a_mtp, engine_config=EngineConfig(verbose=False)), prompt, n).token_ids
    eng = _engine(ckpt_a_mtp, method)
    policy = eng.scheduler.policy
    policy.observe_step(False, 1, 1.0)
    policy.observe_step(True, 1, 2.0)
    policy.observe_step = lambda *a: None
    vocab = vocab_of(ckpt_a_mtp)
    verified_at = []

    def hook(reqs, drafts, first_out):
        start = first_out.tolist()[0]
        verified_at.append(start)
        good = start < 20 or start >= 50
        return torch.tensor([[plain[i] if i < n and good else (plain[min(i, n - 1)] + 1) % vocab
                              for i in range(start, start + 3)]])
    eng.worker.draft_hook = hook
    out = _greedy(eng, prompt, n)
    assert out.token_ids == plain
    collapsed = [s for s in verified_at if 30 <= s < 50]
    recovered = [s for s in verified_at if s >= 100]
    assert len(collapsed) <= 3, verified_at  # a probe or two while the drafts are wrong
    assert len(recovered) >= 6, verified_at  # verifying again (k + 1 tokens each) well before the end
    assert out.spec.plain_steps >= 25 and out.spec.verify_steps >= 10


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_adaptive_batches_mix_plain_and_verify_steps_losslessly(ckpt_a_mtp, method):
    """Random weights: drafts are mostly wrong, so the adaptive engine decodes mostly plainly; with requests
    arriving and finishing at different times the batch goes through verify, plain and drafting-plain steps, and
    the greedy tokens are plain decoding's. The engine measured both kinds of steps."""
    vocab = vocab_of(ckpt_a_mtp)
    prompts = random_prompts(vocab, [5, 17, 9, 30, 12], seed=22)
    ref_eng = Engine(ckpt_a_mtp, engine_config=EngineConfig(verbose=False, chunk_size=8))
    refs = [_greedy(ref_eng, p, 24 + 3 * i).token_ids for i, p in enumerate(prompts)]
    eng = _engine(ckpt_a_mtp, method, chunk_size=8, max_num_seqs=3)
    rids = [eng.add_request(p, SamplingParams(max_tokens=24 + 3 * i, temperature=0)) for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    outs = [eng.pop_finished(r) for r in rids]
    assert [o.token_ids for o in outs] == refs
    assert sum(o.spec.plain_steps for o in outs) > 0 and sum(o.spec.verify_steps for o in outs) > 0
    measured = {verify for verify, _ in eng.scheduler.policy.costs}
    assert measured == {True, False}


def test_plain_steps_keep_the_mtp_heads_kv_as_drafting_steps_write_it(ckpt_a_mtp):
    """A plain step writes only the MTP head's keys and values of its position (``MTPHead.write_kv``); they equal
    the ones the whole head computes there when the step drafts, so drafts after a stretch of plain decoding attend
    to a complete history."""
    from helpers import cycle_steps

    prompt = random_prompts(vocab_of(ckpt_a_mtp), [11], seed=23)[0]
    kv = []
    for pattern in (("plain",), ("draft",)):
        eng = cycle_steps(_engine(ckpt_a_mtp, "mtp", overlap=False), pattern)
        rid = eng.add_request(prompt, SamplingParams(max_tokens=40, temperature=0))
        for _ in range(12):
            eng.step()
        req = eng._reqs[rid]
        assert req.spec.plain_steps >= 10 and req.spec.verify_steps == 0
        tables = eng.caches.req_slots
        n = int(tables.seq_len[req.req_slot])
        locs = tables.req_to_token[req.req_slot, :n]
        layer = eng.caches.kv_pool.k.shape[0] - 1  # the head's own KV layer comes after the target's
        kv.append((eng._reqs[rid].output_ids[:], eng.caches.kv_pool.k[layer, locs].clone(),
                   eng.caches.kv_pool.v[layer, locs].clone()))
    assert kv[0][0] == kv[1][0]
    assert torch.allclose(kv[0][1], kv[1][1], atol=1e-5) and torch.allclose(kv[0][2], kv[1][2], atol=1e-5)
    assert kv[0][1].abs().sum() > 0


def test_ngram_rows_whose_lookup_found_nothing_emit_one_token_a_verify(ckpt_a_mtp):
    """Every step verifies (fixed policy) and the lookup proposes the right continuation each time, but flagged as
    no match: those rows accept nothing and emit the target's one token, as a plain row would; flagged as a match,
    the same drafts are accepted. Greedy output is plain decoding's either way."""
    prompt = random_prompts(vocab_of(ckpt_a_mtp), [10], seed=24)[0]
    n = 16
    plain = _greedy(Engine(ckpt_a_mtp, engine_config=EngineConfig(verbose=False)), prompt, n).token_ids
    for matched in (False, True):
        eng = _engine(ckpt_a_mtp, "ngram", spec_policy="fixed")
        drafter = eng.worker.drafter

        def propose(hist, lens, matched=matched):  # the true continuation after each row's history
            out = []
            for row, length in zip(hist.tolist(), lens.tolist()):
                start = int(length) - len(prompt)  # output tokens already in the history
                out.append([plain[min(start + i, n - 1)] for i in range(drafter.k)])
            return torch.tensor(out), torch.full((hist.shape[0],), matched)
        drafter.propose = propose
        out = _greedy(eng, prompt, n)
        assert out.token_ids == plain
        if matched:
            assert out.spec.accepted_tokens > 0
        else:
            assert out.spec.accepted_tokens == 0 and out.spec.verify_steps == n - 1
