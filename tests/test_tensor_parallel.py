"""Tensor parallelism on the CPU: two processes over gloo give exactly the single process's tokens (greedy, float32,
plain and speculative), each rank holds only its shard, and a model the size does not divide is refused up front."""

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.models.registry import read_config
from hylo.engine.engine import load_model
from hylo.models.loader import SafetensorsReader
from hylo.parallel.group import TPGroup
from hylo.parallel.sharding import ShardedReader

from helpers import random_prompts, vocab_of


@pytest.fixture(scope="module")
def prompts(ckpt_a_mtp):
    return random_prompts(vocab_of(ckpt_a_mtp), [5, 17, 1, 30, 9], seed=41)


@pytest.mark.parametrize("spec", [None, "mtp", "ngram"])
def test_two_ranks_match_one(ckpt_a_mtp, prompts, spec):
    kw = dict(speculative=spec, num_speculative_tokens=2) if spec else {}
    params = SamplingParams(max_tokens=12, temperature=0)
    one = LLM(ckpt_a_mtp, verbose=False, chunk_size=16, **kw)
    ref = one.generate(prompts, params, use_tqdm=False)
    two = LLM(ckpt_a_mtp, verbose=False, chunk_size=16, tensor_parallel_size=2, **kw)
    try:
        out = two.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
        if spec:
            assert [o.spec.as_dict() for o in out] == [o.spec.as_dict() for o in ref]
        if spec is None:  # the logits themselves: sums in another order, nothing more
            a, b = one.engine.prompt_logits(prompts[3]), two.engine.prompt_logits(prompts[3])
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
            # a seeded sampled request is the same too
            sp = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=5)
            assert two.generate(prompts[0], sp, use_tqdm=False)[0].token_ids == \
                one.generate(prompts[0], sp, use_tqdm=False)[0].token_ids
            # streaming ends by dropping its request on every rank: the followers keep serving after it (a second
            # pop of the finished request killed them, and the next call failed)
            streamed = list(two.stream(prompts[1], params))[-1].token_ids
            assert streamed == ref[1].token_ids
            assert two.generate(prompts[2], params, use_tqdm=False)[0].token_ids == ref[2].token_ids
    finally:
        two.close()


def test_each_rank_holds_only_its_shard(ckpt_a_mtp):
    full = load_model(ckpt_a_mtp, torch.float32, torch.device("cpu"))
    total = sum(p.numel() for p in full.model.parameters())
    shards = [load_model(ckpt_a_mtp, torch.float32, torch.device("cpu"), tp=TPGroup(r, 2)) for r in range(2)]
    for s in shards:
        # everything but norms, routers and the replicated pieces is halved
        assert sum(p.numel() for p in s.model.parameters()) < 0.56 * total
        assert s.local_config.num_attention_heads * 2 == full.config.num_attention_heads
    mc = read_config(ckpt_a_mtp)
    readers = [ShardedReader(SafetensorsReader(ckpt_a_mtp), mc, r, 2) for r in range(2)]
    name = "model.layers.0.linear_attn.conv1d.weight"
    whole = SafetensorsReader(ckpt_a_mtp).get(name)
    kd, vd = mc.linear_key_dim, mc.linear_value_dim
    parts = [r.get(name).split([kd // 2, kd // 2, vd // 2]) for r in readers]
    for i, section in enumerate(whole.split([kd, kd, vd])):  # q, k and v channels each split by head
        assert torch.equal(torch.cat([p[i] for p in parts]), section)
    down = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert torch.equal(torch.cat([r.get(down) for r in readers], dim=1), SafetensorsReader(ckpt_a_mtp).get(down))


def test_a_model_the_size_does_not_divide_is_refused(ckpt_b):
    with pytest.raises(ValueError, match="linear_num_key_heads=1"):
        LLM(ckpt_b, verbose=False, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(ckpt_b, verbose=False, tensor_parallel_size=0)


def test_tp_bench_harness_runs_on_cpu():
    """The harness ``hylo bench --tensor-parallel-size`` uses on GPUs: random shards built per rank, decoding
    states set up on every rank, steps timed, processes gone afterwards."""
    import multiprocessing

    from hylo.bench.tp import RandomModel, tp_decode_records

    recs = tp_decode_records(RandomModel("tiny"), 2, device="cpu", batches=(1, 3), ctx=40, steps=3)
    assert [r["batch_size"] for r in recs] == [1, 3] and all(r["ms_per_step"] > 0 for r in recs)
    assert all(r["tensor_parallel_size"] == 2 for r in recs)
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_a_script_without_a_main_guard_fails_fast(tmp_path):
    """A script that builds a tensor-parallel LLM at import time: each spawned rank re-runs it and dies at once.
    Rank 0 says so (and what to do) in seconds, instead of waiting in init_process_group for the 30-minute
    collective timeout."""
    import os
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from hylo import LLM\nLLM(None, device='cpu', verbose=False, tensor_parallel_size=2)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode != 0
    assert "rank 1 exited" in run.stderr and "__main__" in run.stderr
