"""The overlap loop on the GPU: steady-state speculative decoding steps make no synchronising CUDA call at all
(``torch.cuda.set_sync_debug_mode("error")`` turns any into an exception), at batch 1, 16 and a padded size."""

import pytest
import torch

from hylo import SamplingParams

from helpers import cycle_steps
from test_engine_gpu import _engine, _prompts, gpu_ckpt  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def steps_without_sync(eng, steps: int) -> None:
    """``steps`` engine steps in which any synchronising CUDA call raises, and no host read blocks."""
    blocking = eng.host_reads.blocking
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert eng.host_reads.blocking == blocking


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
@pytest.mark.parametrize("bs", [1, 5, 16])  # 5 runs padded to the captured 8
@pytest.mark.parametrize("steps", ["adaptive", "cycle"])
def test_steady_state_spec_steps_never_sync(gpu_ckpt, spec, bs, steps):  # noqa: F811
    """``adaptive``: the policy as it runs (measuring its step costs with CUDA events); ``cycle``: plain, drafting
    plain and verify steps in turn, every kind of step inside the checked window."""
    eng = _engine(gpu_ckpt, spec=spec, dtype="bfloat16")
    if steps == "cycle":
        cycle_steps(eng, ("plain", "draft", "verify", "draft"))
    assert eng.ec.overlap and eng.model_worker.graphs is not None
    rids = []
    for i, p in enumerate(_prompts(bs, seed=bs)):
        # greedy and sampled rows together: the rejection-sampling path is part of the steady state too
        params = SamplingParams(max_tokens=10 ** 6, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
        rids.append(eng.add_request(p, params))
    for _ in range(6):  # prefill, then a few verify steps
        eng.step()
    assert all(r.decoding for r in eng.scheduler.running) and not eng.scheduler.waiting
    overlapped = eng.host_reads.overlapped
    before = [len(eng._reqs[r].output_ids) for r in rids]
    steps_without_sync(eng, 12)
    assert eng.host_reads.overlapped == overlapped + 12
    assert all(len(eng._reqs[r].output_ids) >= b + 12 for r, b in zip(rids, before))
    for rid in rids:
        eng.abort(rid)
    eng.drain()


@pytest.mark.parametrize("spec", [None, "ngram", "mtp"])
def test_steady_state_steps_with_constrained_rows_never_sync(gpu_ckpt, spec):  # noqa: F811
    """Constrained rows (a JSON schema over a synthetic vocabulary whose string fields keep a random model writing)
    beside free ones, greedy and sampled: the masks come from the device states and the states move on the device,
    so the steady state still makes no synchronising call, plain or speculative."""
    from hylo.bench.structured import SCHEMA, SyntheticTokenizer
    from hylo.constrain.automaton import AutomatonCache
    from hylo.constrain.spec import Constraint

    eng = _engine(gpu_ckpt, spec=spec, dtype="bfloat16")
    tok = SyntheticTokenizer(eng.model_config.vocab_size)
    eng.tokenizer, eng.automata = tok, AutomatonCache(tok, eng.model_config.vocab_size)
    eng.eos_ids = eng.model_worker.eos_ids = {3}  # the test model has none; a constraint needs one
    constraint = Constraint.json_schema(SCHEMA)
    rids = []
    for i, p in enumerate(_prompts(6, seed=4)):
        params = SamplingParams(max_tokens=10 ** 6, temperature=0.0 if i % 2 else 0.8, seed=i,
                                constraint=constraint if i < 4 else None, ignore_eos=i >= 4)
        rids.append(eng.add_request(p, params))
    for _ in range(6):
        eng.step()
    assert not eng.scheduler.waiting and all(r.decoding for r in eng.scheduler.running)
    steps_without_sync(eng, 12)
    eng.drain()
    auto = eng.compile_constraint(constraint)
    for rid in rids[:4]:
        out = eng._reqs[rid].output_ids
        assert len(out) >= 12 and auto.walk(out) is not None  # every token the constraint allowed
        eng.abort(rid)
    for rid in rids[4:]:
        eng.abort(rid)
    eng.drain()
