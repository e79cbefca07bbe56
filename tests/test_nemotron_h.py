"""Nemotron-H (Mamba2, attention and squared-ReLU MLP blocks) against transformers 5.24's own model, on a checkpoint
it wrote with ``save_pretrained`` (``backbone.*`` names, as released): prompt logits, greedy batches of mixed
lengths through chunked prefill whose chunks split the scan's, n-gram speculation and prefix caching exact, and
what is not served yet refused before a weight is read."""

import json
import os

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine

from helpers import all_freed, hf_greedy, random_prompts, run_all, spec_engine


@pytest.fixture
def nemotron(nemotron_h):  # (path, the transformers model): conftest's session checkpoint
    return nemotron_h


def test_prefill_logits_match_transformers(nemotron):
    path, hf = nemotron
    eng = Engine(path, device="cpu", dtype="float32",
                 engine_config=EngineConfig(chunk_size=6, max_num_seqs=4, verbose=False))
    for prompt in random_prompts(97, [1, 11, 53], seed=11):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        ours = eng.prompt_logits(prompt)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_batch_of_mixed_lengths_matches_transformers(nemotron):
    path, hf = nemotron
    prompts = random_prompts(97, [4, 37, 1, 19, 66], seed=12)
    llm = LLM(path, device="cpu", dtype="float32", chunk_size=13, max_num_seqs=8, verbose=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)


def test_ngram_speculation_and_prefix_caching_are_exact(nemotron):
    path, _ = nemotron
    # repetitive prompts, so that n-gram drafts get accepted
    prompts = [(p * 4)[:n] for p, n in zip(random_prompts(97, [5, 7, 3], seed=13), [20, 31, 12])]
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = run_all(spec_engine(path, enable_prefix_caching=False), prompts, params)
    eng = spec_engine(path, "ngram")
    outs = run_all(eng, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.spec.accepted_tokens for o in outs) > 0
    # next turns resume from the cached state snapshots (and n-gram keeps verifying them)
    turn2 = [p + o.token_ids + q for p, o, q in zip(prompts, plain, random_prompts(97, [3, 9, 4], seed=14))]
    cold = run_all(spec_engine(path, enable_prefix_caching=False), turn2, params)
    hot = run_all(eng, turn2, params)
    assert [o.token_ids for o in hot] == [o.token_ids for o in cold]
    assert all(o.num_cached_tokens >= len(p) for o, p in zip(hot, prompts))
    assert all_freed(eng)


def test_unsupported_forms_are_refused_before_any_weight(tmp_path, nemotron):
    path, _ = nemotron
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for change, words in (({"layers_block_type": ["linear_attention", "moe"]}, "MoE blocks"),
                          ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
                          ({"mamba_num_heads": 5}, "n_groups")):
        bad = tmp_path / words.replace(" ", "_")
        bad.mkdir()
        with open(bad / "config.json", "w") as f:
            json.dump({**cfg, **change}, f)
        # no weights at all in the folder: the refusal comes from the config alone
        with pytest.raises(ValueError, match=words):
            Engine(str(bad), device="cpu", engine_config=EngineConfig(verbose=False))
    with pytest.raises(ValueError, match="no MTP head"):
        spec_engine(path, "mtp")


def test_tensor_parallelism_is_refused_by_name(nemotron):
    path, _ = nemotron
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM(path, device="cpu", tensor_parallel_size=2, verbose=False)
