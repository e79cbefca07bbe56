"""Log probabilities (from the raw distribution, on the device in the sampling pass) and the logit changes before
sampling (bias, min_tokens, repetition / frequency / presence penalties, in the per-slot device tables), against
float64 references of the same model's logits; identical under MTP and n-gram speculation."""

import pytest
import torch

from hylo import LLM, SamplingParams

from helpers import random_prompts, run_all, spec_engine, vocab_of


@pytest.mark.parametrize("spec", [None, "ngram", "mtp"])
def test_logprobs_are_the_raw_distributions(ckpt_a_mtp, spec):
    """Each generated token's log probability and its top 4 alternatives equal a float64 log_softmax of the
    model's logits at that position (temperature and top-p do not change them), with and without speculation."""
    ref_eng = spec_engine(ckpt_a_mtp)
    eng = spec_engine(ckpt_a_mtp, spec)
    prompts = random_prompts(vocab_of(ckpt_a_mtp), [5, 23, 11], seed=40)
    for params in (SamplingParams(max_tokens=9, temperature=0, logprobs=4),
                   SamplingParams(max_tokens=9, temperature=0.8, top_p=0.7, seed=3, logprobs=4)):
        for p, o in zip(prompts, run_all(eng, prompts, params)):
            assert len(o.logprobs) == len(o.token_ids)
            full = ref_eng.prompt_logits(p + o.token_ids[:-1]).double().log_softmax(-1)[len(p) - 1:]
            for i, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
                assert abs(lp.logprob - full[i, tok].item()) < 1e-4
                vals, ids = full[i].topk(4)
                assert [t for t, _ in lp.top] == ids.tolist()
                assert max(abs(v - w) for (_, v), w in zip(lp.top, vals.tolist())) < 1e-4


def test_logprobs_match_hf_on_the_embedded_default():
    """The trained embedded default against transformers' own Qwen3NextForCausalLM on the same directory."""
    from transformers import Qwen3NextForCausalLM

    from hylo.models.default import trained_default_path

    path = trained_default_path()
    if path is None:
        pytest.skip("no trained default in this install")
    llm = LLM(None, device="cpu", dtype="float32", verbose=False)
    prompt = llm.tokenizer.encode("def fibonacci(n):\n    ")
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=2), use_tqdm=False)[0]
    hf = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0].double()
    lps = logits.log_softmax(-1)[len(prompt) - 1:]
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok == lps[i].argmax().item()
        assert abs(lp.logprob - lps[i, tok].item()) < 1e-4
        assert [t for t, _ in lp.top] == lps[i].topk(2).indices.tolist()


def _reference(eng, prompt, params, stop_ids, steps):
    """Greedy decoding with the logit changes applied by hand in float64 to the model's logits at every step."""
    out = []
    for _ in range(steps):
        x = eng.prompt_logits(prompt + out)[-1].double()
        for tok, b in (params.logit_bias or {}).items():
            x[tok] += b
        if len(out) < params.min_tokens:
            x[list(stop_ids)] = float("-inf")
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.numel()).double()
        seen = (counts > 0) | torch.bincount(torch.tensor(prompt), minlength=x.numel()).bool()
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
        out.append(int(x.argmax()))
    return out


@pytest.mark.parametrize("spec", [None, "ngram", "mtp"])
def test_penalties_and_bias_match_a_reference_loop(ckpt_a_mtp, spec):
    vocab = vocab_of(ckpt_a_mtp)
    ref_eng = spec_engine(ckpt_a_mtp)
    eng = spec_engine(ckpt_a_mtp, spec)
    prompts = random_prompts(vocab, [6, 17], seed=41)
    plain = run_all(ref_eng, prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    cases = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.6),
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.8),
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=-1.0,
                       logit_bias={3: 4.0, 11: -100.0}),
        # the plain output's first token is a stop id: masked until three tokens are out, then it may end it
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, min_tokens=3,
                       stop_token_ids=[plain[0].token_ids[0]], repetition_penalty=1.2),
    ]
    for params in cases:
        outs = run_all(eng, prompts, params)
        for p, o in zip(prompts, outs):
            stop_ids = set(params.stop_token_ids or ())
            want = _reference(ref_eng, p, params, stop_ids, len(o.token_ids))
            assert o.token_ids == want, (params, o.token_ids, want)
            if params.min_tokens:
                assert not set(o.token_ids[:3]) & stop_ids


def test_offline_n_samples_each_prompt_n_times(ckpt_a):
    llm = LLM(ckpt_a, verbose=False)
    prompts = random_prompts(vocab_of(ckpt_a), [7, 12], seed=42)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=3), use_tqdm=False)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p and o.token_ids == o.outputs[0].token_ids
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # the samples differ
        for i, c in enumerate(o.outputs):  # choice i is the request seeded seed + i
            alone = llm.generate([p], SamplingParams(max_tokens=6, temperature=1.0, seed=9 + i), use_tqdm=False)
            assert c.token_ids == alone[0].token_ids


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_prompt_logprobs_over_chunks(ckpt_a_mtp, spec):
    """prompt_logprobs=N: every prompt token after the first, across prefill chunks of 16, against a float64
    log_softmax of the prompt's logits, with its rank in the whole vocabulary; the first prompt token has None."""
    eng = spec_engine(ckpt_a_mtp, spec)
    ref = spec_engine(ckpt_a_mtp)
    prompts = random_prompts(vocab_of(ckpt_a_mtp), [37, 2, 1], seed=43)
    outs = run_all(eng, prompts, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3, logprobs=1))
    for p, o in zip(prompts, outs):
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        full = ref.prompt_logits(p).double().log_softmax(-1)
        for i in range(1, len(p)):
            lp = o.prompt_logprobs[i]
            assert abs(lp.logprob - full[i - 1, p[i]].item()) < 1e-4
            assert [t for t, _ in lp.top] == full[i - 1].topk(3).indices.tolist()
            above = [int((full[i - 1] > full[i - 1, p[i]] + d).sum()) + 1 for d in (1e-5, -1e-5)]  # (near-ties)
            assert above[0] <= lp.rank <= above[1]
        assert len(o.logprobs) == len(o.token_ids)
