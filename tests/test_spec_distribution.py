"""Speculative sampling keeps the target's output distribution exactly (chi-square tests with fixed seeds)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hylo import LLM, SamplingParams
from hylo.models.registry import parse_config
from hylo.models.default import default_model_config
from hylo.models.random_init import random_checkpoint
from hylo.speculative.verify import rejection_accept

# chi-square critical value at p = 0.001 for dof 1..40 (Wilson-Hilferty approximation is enough here)


def _chi2_crit(dof: int) -> float:
    z = 3.090  # one-sided 0.999
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor):
    """Pearson statistic, merging cells whose expected count is under 5 into one."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < 5
    c = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    e = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = e > 0
    stat = (((c - e) ** 2) / e)[keep].sum().item()
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_keeps_target_marginals(point_mass):
    g = torch.Generator().manual_seed(0)
    n, k, vocab = 40000, 2, 6
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    if point_mass:  # n-gram drafts: a fixed proposal, q is a point mass on it
        drafts = torch.tensor([[2, 4]]).repeat(n, 1)
        qs = None
    else:
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)
        qs = q[None].repeat(n, 1, 1)
    emitted, accepted = rejection_accept(drafts, qs, p[None].repeat(n, 1, 1), torch.arange(n) * 31 + 7,
                                         torch.zeros(n, dtype=torch.int64))
    stat, dof = _chi2(torch.bincount(emitted[:, 0], minlength=vocab), p[0])
    assert stat < _chi2_crit(dof), stat
    # given the first draft was accepted, the second token follows p_1 (p_1 is conditioned on d_1 by construction)
    sel = accepted >= 1
    stat, dof = _chi2(torch.bincount(emitted[sel, 1], minlength=vocab), p[1])
    assert stat < _chi2_crit(dof), stat
    # acceptance rate of the first draft is sum_x min(p, q)
    expected_rate = (torch.minimum(p[0], q[0]).sum() if not point_mass else p[0, 2]).item()
    assert abs(sel.float().mean().item() - expected_rate) < 0.01


@pytest.fixture(scope="module")
def tiny_vocab_ckpt(tmp_path_factory):
    """A small random checkpoint with an 8-token vocabulary and peaked distributions (plus an MTP head)."""
    base = default_model_config()
    cfg = base.to_hf_dict()
    cfg.update(vocab_size=8, hidden_size=32, eos_token_id=None, linear_key_head_dim=16, linear_value_head_dim=16,
               head_dim=16, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    mc = parse_config(cfg)
    path = tmp_path_factory.mktemp("tiny_vocab")
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f)
    save_file(random_checkpoint(mc, seed=3, std=0.25), str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculative_sampling_matches_target_distribution(tiny_vocab_ckpt, method):
    """The joint distribution of the first two generated tokens (the second comes out of a verify step) equals the
    target's p(x1) p(x2 | x1), computed from the model's own prompt logits."""
    prompt = [1, 5, 2, 7, 3]
    n = 3000
    llm = LLM(tiny_vocab_ckpt, speculative=method, num_speculative_tokens=2, max_num_seqs=64, spec_policy="fixed",
              verbose=False)
    params = [SamplingParams(max_tokens=2, temperature=1.0, seed=s) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    assert all(o.spec.verify_steps == 1 for o in outs)
    pairs = torch.tensor([o.token_ids for o in outs])
    counts = torch.bincount(pairs[:, 0] * 8 + pairs[:, 1], minlength=64)
    eng = llm.engine
    p1 = torch.softmax(eng.prompt_logits(prompt)[-1], -1)
    joint = torch.stack([p1[a] * torch.softmax(eng.prompt_logits(prompt + [a])[-1], -1) for a in range(8)])
    stat, dof = _chi2(counts, joint.flatten())
    assert stat < _chi2_crit(dof), (stat, dof)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_sampling_stays_exact_when_plain_and_verify_steps_alternate(tiny_vocab_ckpt, method):
    """The adaptive policy mixes plain decode steps (drafting at their end, or not) with verify steps. Forced to
    alternate, requests admitted at different times get their second and third tokens from different kinds of
    steps, among them verifies of drafts made at the end of a plain step; the joint distribution of the first three
    tokens is still the target's p(x1) p(x2 | x1) p(x3 | x1, x2)."""
    from hylo.engine.spec_policy import StepChoice

    prompt = [6, 1, 4]
    n = 4000
    llm = LLM(tiny_vocab_ckpt, speculative=method, num_speculative_tokens=2, max_num_seqs=48, verbose=False)
    eng = llm.engine
    calls = iter(range(10 ** 9))

    def alternate(reqs):  # verify every other decoding step (when every row has drafts), else plain, drafting
        verify = next(calls) % 2 == 1 and all(r.has_drafts for r in reqs)
        return StepChoice(verify, True)
    eng.scheduler.policy.choose = alternate
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    assert sum(o.spec.plain_steps for o in outs) > n // 4 and sum(o.spec.verify_steps for o in outs) > n // 4
    tokens = torch.tensor([o.token_ids for o in outs])
    counts = torch.bincount(tokens[:, 0] * 64 + tokens[:, 1] * 8 + tokens[:, 2], minlength=512)
    p1 = torch.softmax(eng.prompt_logits(prompt)[-1], -1)
    joint = []
    for a in range(8):
        p2 = torch.softmax(eng.prompt_logits(prompt + [a])[-1], -1)
        for b in range(8):
            joint.append(p1[a] * p2[b] * torch.softmax(eng.prompt_logits(prompt + [a, b])[-1], -1))
    stat, dof = _chi2(counts, torch.cat(joint))
    assert stat < _chi2_crit(dof), (stat, dof)
