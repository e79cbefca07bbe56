"""The graph runner's staging and padding, on the CPU: off CUDA a "graph" re-runs its pass on the runner's static
buffers at every replay, so everything but the capture itself (the stage's layout, the padded tail, the prologue
that gathers a step from the request tables, the copied passes' replay hooks) runs here as it does on the GPU.
The GPU tests replay real CUDA graphs."""

import pytest
import torch

from hylo import SamplingParams
from hylo.config import EngineConfig
from hylo.core import ForwardMode
from hylo.engine.engine import Engine
from hylo.speculative.setup import SpecSetup

from helpers import check_against, cycle_steps, drive, random_prompts, traffic, vocab_of

SIZES = [1, 2, 4, 8]


def _engine(path, spec=None, graphs=False, **kw):
    ec = EngineConfig(verbose=False, **({"speculative": spec} if spec else {}), **kw)
    eng = Engine(path, engine_config=ec, spec_setup=SpecSetup(spec) if spec else None)
    if graphs:
        eng.worker.capture_graphs(SIZES, verbose=False)
    return eng


def _count_replays(eng):
    """Count each pass's replays by padded size: {(name, raw_bs, bs)}."""
    graphs, seen = eng.model_worker.graphs, set()
    run, run_staged = graphs.run, graphs.run_staged

    def counted_run(name, batch, extras=None):
        seen.add((name, batch.batch_size, graphs.padded_size(batch.batch_size)))
        return run(name, batch, extras)

    def counted_staged(name, req_slots, state_slots, kv):
        seen.add((name, len(req_slots), graphs.padded_size(len(req_slots))))
        return run_staged(name, req_slots, state_slots, kv)
    graphs.run, graphs.run_staged = counted_run, counted_staged
    return seen


@pytest.mark.parametrize("spec", [None, "mtp", "ngram"])
def test_replayed_steps_give_the_eager_outputs(ckpt_a_mtp, spec):
    """Random traffic (arrivals, aborts, stop tokens, sampled rows) with the graph passes at captured sizes 1, 2, 4, 8
    (batches of 3 and 5-7 padded, 9 and more eager) gives exactly the outputs of the engine without graphs."""
    vocab = vocab_of(ckpt_a_mtp)
    work = traffic(vocab, 24, seed=21, max_steps_between=1, abort_frac=0.15, max_tokens=(4, 24))
    for i, (p, params, at, ab) in enumerate(work):
        if i % 3 == 0:  # sampled rows: the decode graph's sampling path, the verify graph of sampled rows
            work[i] = (p, SamplingParams(max_tokens=params.max_tokens, temperature=0.8, top_k=20, seed=i), at, ab)
    opts = dict(chunk_size=16, max_num_seqs=10)
    # both engines' speculative steps cycle through plain, drafting-plain and verify steps: the same choices
    ref, _ = drive(cycle_steps(_engine(ckpt_a_mtp, spec, **opts)), work)
    eng = cycle_steps(_engine(ckpt_a_mtp, spec, graphs=True, **opts))
    seen = _count_replays(eng)
    outs, _ = drive(eng, work)
    assert check_against(outs, ref, work) > 0
    # the plain steps too: the greedy staged ones with and without drafting at their end, the sampled rows' forward
    plain = {"plain_step", "plain_draft", "plain"}
    names = {"decode"} if spec is None else {"verify"} | plain if spec == "ngram" else {"spec_step", "verify"} | plain
    for name in names - plain:  # not vacuous: each pass replayed with and without padding
        assert any(n == name and raw < bs for n, raw, bs in seen), (name, seen)
        assert any(n == name and raw == bs for n, raw, bs in seen), (name, seen)
    if spec is not None:  # plain passes, padded and not (which ones depends on the traffic: the greedy staged
        # ones need a batch of greedy rows; the padded staged test below checks each of them alone)
        assert any(n in plain and raw < bs for n, raw, bs in seen) and any(n in plain and raw == bs
                                                                            for n, raw, bs in seen), seen


def _poison_unowned(eng, sched):
    """NaN in every state slot and KV location no running request uses (slot 0 and location 0, the padding
    targets, excepted; prefix-cache snapshots too): a padded row that read or wrote them would show."""
    c = eng.caches
    used = {r.state_slot for r in sched.reqs}
    free = [s for s in range(1, c.state_pool.num_slots + 1) if s not in used]
    for pool in (c.state_pool.conv, c.state_pool.recurrent):
        pool[:, free] = float("nan")
    # a request's locations: those of the cached prefix it shares (in its req_to_token row) and its own (this
    # step's new ones included, which reach req_to_token only when the step runs)
    r2t = c.req_slots.req_to_token
    owned = torch.cat([r2t[r.req_slot, :r.prefix_len] for r in eng.scheduler.running]
                      + [loc for r in eng.scheduler.running for loc in r.kv_locs])
    unowned = torch.ones(c.kv_pool.k.shape[1], dtype=torch.bool)
    unowned[owned] = False
    unowned[0] = False
    c.kv_pool.k[:, unowned] = float("nan")
    c.kv_pool.v[:, unowned] = float("nan")
    return sorted(used), free, unowned


def _pools(eng):
    c = eng.caches
    return [t.clone() for t in (c.kv_pool.k, c.kv_pool.v, c.state_pool.conv, c.state_pool.recurrent)]


@pytest.mark.parametrize("spec,name", [(None, "decode"), ("mtp", "spec_step"), ("mtp", "plain_step"),
                                       ("mtp", "plain_draft")])
def test_a_padded_staged_step_equals_the_eager_step_and_touches_only_dummies(ckpt_a_mtp, spec, name):
    """Three decoding rows, replayed at size 4 (the fourth row padding): the outputs, request tables and caches
    (the MTP head's KV of a plain step included) equal the eager step's; no unowned state slot or KV location
    changes."""
    eng = _engine(ckpt_a_mtp, spec, graphs=True, overlap=False, max_num_seqs=8,
                  **({"spec_policy": "fixed"} if name == "spec_step" else {}))
    if name.startswith("plain"):  # the policy decodes plainly, drafting at the step's end or not
        cycle_steps(eng, ("draft",) if name == "plain_draft" else ("plain",))
    for p in random_prompts(vocab_of(ckpt_a_mtp), [7, 12, 3], seed=4):
        eng.add_request(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(3):  # prefill, then decoding
        eng.step()
    sched = eng.scheduler.schedule()
    mode = ForwardMode.TARGET_VERIFY if name == "spec_step" else ForwardMode.DECODE
    assert sched.mode is mode and len(sched.reqs) == 3
    w, tables = eng.model_worker, eng.caches.req_slots
    used, free, unowned = _poison_unowned(eng, sched)
    snap = (_pools(eng), tables.seq_len.clone(), tables.last_token.clone(), tables.req_to_token.clone())
    drafts = None if spec is None else eng.worker.drafter.drafts
    fed = drafts if name == "spec_step" else None
    saved_drafts = None if drafts is None else drafts.clone()
    with torch.inference_mode():
        batch = w.build_batch(sched, drafts=fed)
        if spec is None:
            eager = {"logits": w.model.compute_logits(w.forward_hidden(batch))}
            tables.record(batch.req_slots, batch.seq_lens, batch.req_slots, eager["logits"].argmax(-1))
        elif name == "spec_step":
            w.backend.init_forward_metadata(batch)
            eager = eng.worker._greedy_step(batch)
        else:
            w.backend.init_forward_metadata(batch)
            eager = eng.worker._greedy_plain(batch, name == "plain_draft")
    eager_state = (_pools(eng), tables.seq_len.clone(), tables.last_token.clone(),
                   None if drafts is None else drafts.clone())
    # back to the state before the step, the KV rows of this step's new locations included
    c = eng.caches
    for dst, src in zip((c.kv_pool.k, c.kv_pool.v, c.state_pool.conv, c.state_pool.recurrent), snap[0]):
        dst.copy_(src)
    tables.seq_len.copy_(snap[1])
    tables.last_token.copy_(snap[2])
    tables.req_to_token.copy_(snap[3])
    if drafts is not None:
        drafts.copy_(saved_drafts)
    with torch.inference_mode():
        out, gbatch = w.run_staged(name, sched)
    assert w.graphs.padded_size(3) == 4 and gbatch.batch_size == 3
    for key, value in eager.items():
        assert torch.allclose(out[key], value, atol=1e-5), key
    assert torch.equal(gbatch.positions, batch.positions) and torch.equal(gbatch.out_cache_loc, batch.out_cache_loc)
    after = _pools(eng)
    real = torch.tensor([r.req_slot for r in sched.reqs])
    assert torch.equal(tables.seq_len[real], eager_state[1][real])
    assert torch.equal(tables.last_token[real], eager_state[2][real])
    if drafts is not None:
        assert torch.equal(drafts[real], eager_state[3][real])
    for i, (a, e, b) in enumerate(zip(after, eager_state[0], snap[0])):
        if i < 2:  # KV: the real rows' new entries equal eager's; unowned locations stay NaN
            assert torch.equal(a[:, unowned].isnan(), b[:, unowned].isnan())
            owned = ~unowned
            owned[0] = False
            assert torch.allclose(a[:, owned], e[:, owned], atol=1e-5)
        else:  # states: the real rows' slots equal eager's, every other slot unchanged
            assert torch.allclose(a[:, used], e[:, used], atol=1e-5)
            assert torch.equal(a[:, free].isnan(), b[:, free].isnan())


def test_capture_keeps_the_garbage_collector_off_and_restores_it():
    """A collection during a CUDA capture may destroy an older engine's graphs, which invalidates the capture
    (seen on the H100 when one test's engine was collected while the next captured): the runner collects before
    capturing, keeps the collector off while it captures every size, and turns it back on afterwards."""
    import gc

    from hylo.engine.graphs import GraphRunner

    seen = []
    runner = GraphRunner(object(), torch.device("cpu"), [1, 2, 4], max_context=16, verbose=False)
    assert gc.isenabled()
    runner.capture("probe", ForwardMode.DECODE, 1, lambda batch, extras: seen.append(gc.isenabled()) or {})
    assert seen == [False, False, False]  # one run per size on the CPU, none with the collector on
    assert gc.isenabled()

    def failing(batch, extras):
        raise RuntimeError("capture failed")
    with pytest.raises(RuntimeError, match="capture failed"):
        runner.capture("broken", ForwardMode.DECODE, 1, failing)
    assert gc.isenabled()  # a failed capture does not leave it off either
