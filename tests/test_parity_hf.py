"""Parity with HF transformers' Qwen3-Next on checkpoints that transformers itself wrote."""

import torch

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine

from helpers import assert_logits_match, hf_greedy, load_hf, make_hf_checkpoint, random_prompts, vocab_of


def test_prefill_logits_match_hf(ckpt):
    hf = load_hf(ckpt)
    eng = Engine(ckpt, device="cpu", dtype="float32", engine_config=EngineConfig(chunk_size=5, max_num_seqs=4))
    assert_logits_match(eng, hf, random_prompts(vocab_of(ckpt), [1, 9, 70], seed=1))


def test_greedy_batch_of_mixed_lengths_matches_hf(ckpt):
    """Prompts of very different lengths run together with a small chunk size (prompts split across chunks,
    prefill and decode rows in the same steps) give exactly HF's greedy tokens."""
    hf = load_hf(ckpt)
    prompts = random_prompts(vocab_of(ckpt), [3, 45, 1, 17, 90, 8], seed=2)
    n = 12
    llm = LLM(ckpt, device="cpu", dtype="float32", chunk_size=16, max_num_seqs=8, verbose=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, n)
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompt
        assert out.text is None  # no tokenizer.json in these checkpoints


def test_sharded_checkpoint_loads_the_same(tmp_path, ckpt_a):
    sharded = make_hf_checkpoint(str(tmp_path / "sharded"), "a", max_shard_size="40KB")
    import os
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    prompt = random_prompts(vocab_of(ckpt_a), [20], seed=3)[0]
    e1 = Engine(ckpt_a, device="cpu", engine_config=EngineConfig(verbose=False))
    e2 = Engine(sharded, device="cpu", engine_config=EngineConfig(verbose=False))
    assert torch.equal(e1.prompt_logits(prompt), e2.prompt_logits(prompt))


def test_bfloat16_error_is_no_worse_than_hf(ckpt_a):
    """bfloat16 rounding changes the logits; ours should change them about as much as transformers' own does."""
    prompt = random_prompts(vocab_of(ckpt_a), [30], seed=4)[0]
    f32 = Engine(ckpt_a, device="cpu", dtype="float32", engine_config=EngineConfig(verbose=False))
    bf16 = Engine(ckpt_a, device="cpu", dtype="bfloat16", engine_config=EngineConfig(verbose=False))
    a, b = f32.prompt_logits(prompt), bf16.prompt_logits(prompt)
    ours = ((a - b).norm() / a.norm()).item()
    with torch.no_grad():
        hf32 = load_hf(ckpt_a)(torch.tensor([prompt])).logits[0]
        hf16 = load_hf(ckpt_a).to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    theirs = ((hf32 - hf16).norm() / hf32.norm()).item()
    assert ours < 2 * theirs + 1e-2, (ours, theirs)
