"""The trained embedded default (``hylo/models/default_ckpt``, from ``tools/train_default.py``): a genuine Qwen3-Next
checkpoint that HF transformers loads and agrees with, whose held-out loss is the recorded one, which writes
syntactically valid Python, and whose MTP head drafts well enough to matter."""

import json
import math
import os
import textwrap

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.models.default import TRAINED_DEFAULT_NAME, trained_default_path

from helpers import load_hf

PATH = trained_default_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="this install ships no trained default")


@pytest.fixture(scope="module")
def llm():
    return LLM(verbose=False)


@pytest.fixture(scope="module")
def record():
    with open(os.path.join(PATH, "training.json")) as f:
        return json.load(f)


def test_it_is_the_default_and_small(llm, record):
    assert llm.engine.model_name == TRAINED_DEFAULT_NAME and not llm.engine.is_random
    assert os.path.getsize(os.path.join(PATH, "model.safetensors")) < 20 * 2 ** 20
    assert llm.tokenizer.vocab_size == record["tokenizer"]["vocab_size"]
    cfg = llm.engine.model_config
    assert cfg.layer_types.count("linear_attention") == 3 * cfg.layer_types.count("full_attention")
    assert cfg.num_experts > 1 and cfg.num_nextn_predict_layers == 1
    assert record["training"]["steps"] > 0 and record["loss"]["heldout"] < record["loss"]["train_last50"] + 2


def test_a_chat_turn_ends_at_im_end(llm):
    """The template-less default chats in ChatML (hylo's fallback template), whose turns end with <|im_end|>: its
    generation config lists that token beside <|endoftext|>, as Qwen's releases do, so a chat answer stops there
    (as an end of sequence: no stop_reason, not in the text)."""
    im_end = llm.tokenizer.token_id("<|im_end|>")
    assert llm.tokenizer.chat_template is None and im_end in llm.engine.eos_ids
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, logit_bias={im_end: 100}),
                       use_tqdm=False)[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([im_end], "stop", None, "")


def test_matches_hf_transformers(llm):
    """HF loads the directory as is; prefill logits agree, and hylo's greedy tokens are HF's argmax on the same
    sequence, up to float32 ties (a full forward without cache: see transformers issue #45513 on multi-token cached
    forwards)."""
    hf = load_hf(PATH)
    tok = llm.tokenizer
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self",
               "    for key, value in sorted(items.items()):\n        if"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        ids = tok.encode(p)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out.token_ids])).logits[0].float()
        ours = llm.engine.prompt_logits(ids)
        assert torch.allclose(ours, logits[:len(ids)], atol=2e-3, rtol=1e-3)
        # each of hylo's tokens is HF's argmax at its position, up to float32 ties: two logits 1e-5 apart (seen on
        # the second token of the first prompt) may order either way between two correct implementations
        steps = logits[len(ids) - 1:-1]
        ours_at = steps.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (ours_at >= steps.max(-1).values - 1e-4).all(), (steps.argmax(-1).tolist(), out.token_ids)
        assert (steps.argmax(-1) == torch.tensor(out.token_ids)).float().mean() > 0.8


def test_heldout_loss_is_the_recorded_one(llm, record):
    with open(os.path.join(PATH, "heldout_sample.txt")) as f:
        sample = f.read()
    ids = llm.tokenizer.encode(sample)
    logits = llm.engine.prompt_logits(ids)
    loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    assert abs(loss - record["loss"]["heldout_sample_bf16_weights"]) < 0.02, loss
    assert loss < 0.5 * math.log(llm.engine.model_config.vocab_size)  # far from a uniform guess


@pytest.mark.parametrize("prefix", ["for i in range(len(", "class Foo(object):\n    def __init__(self",
                                    "    while True:\n        if not os.path.exists("])
def test_completes_a_line_of_python(llm, prefix):
    """The greedy completion of the line makes a block header that Python's own parser accepts."""
    out = llm.generate(prefix, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].text
    line = (prefix + out).split("\n")
    header = textwrap.dedent("\n".join(line[:prefix.count("\n") + 1]))
    assert header.rstrip().endswith(":"), header
    indent = len(header.split("\n")[-1]) - len(header.split("\n")[-1].lstrip())
    compile(header.rstrip() + "\n" + " " * (indent + 4) + "pass\n", "<completion>", "exec")


def test_speculative_mtp_accepts_real_drafts(llm):
    """Greedy MTP speculation is lossless and its head is trained: well over 1.5 tokens per verify step."""
    # the fixed policy: every step verifies (the adaptive one times steps, and a loaded machine may tilt it)
    spec = LLM(verbose=False, speculative="mtp", num_speculative_tokens=3, spec_policy="fixed")
    prompt = "def fibonacci(n):"
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    a = llm.generate(prompt, params, use_tqdm=False)[0]
    b = spec.generate(prompt, params, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids
    assert b.spec.mean_accept_length > 1.5
