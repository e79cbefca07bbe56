"""Speculative sampling keeps the target's output distribution exactly (chi-square tests with fixed seeds), and a
seeded request's very tokens: those of plain decoding."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hylo import LLM, SamplingParams
from hylo.models.registry import parse_config
from hylo.models.default import default_model_config
from hylo.models.random_init import random_checkpoint
from hylo.core import SamplingBatch
from hylo.ops.sampling import draw, sample
from hylo.speculative.verify import coupled_accept, per_position, verify_tokens

from helpers import run_all, spec_engine

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


def _rows(seeds, steps, temperature):
    """A SamplingBatch of len(seeds) rows at one temperature (0: greedy), no top-k / top-p."""
    n = seeds.shape[0]
    return SamplingBatch(torch.full((n,), float(temperature)), torch.ones(n), torch.full((n,), 1 << 30), seeds,
                         steps, temperature == 0, temperature == 0, False, False)


@pytest.mark.parametrize("point_mass", [False, True])
def test_coupled_acceptance_emits_plain_decodings_draws(point_mass):
    """The verify's sampled tokens are exactly the draws plain decoding makes at the same (seed, output index), so
    their distribution is the target's; a point-mass draft is accepted with probability p(d) (as rejection sampling
    accepts it), a draft drawn from q with the same noise with a probability between (1 - TV) / (1 + TV) and
    1 - TV (the best any coupling of p and q reaches)."""
    g = torch.Generator().manual_seed(0)
    n, k, vocab = 40000, 2, 6
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    seeds, steps = torch.arange(n) * 31 + 7, torch.randint(0, 1000, (n,), generator=g)
    if point_mass:  # n-gram drafts: a fixed proposal
        drafts = torch.tensor([[2, 4]]).repeat(n, 1)
    else:  # the MTP head's: drawn from q with the noise of the target's draw at that index
        drafts = torch.stack([draw(q[i].expand(n, vocab), seeds, steps + i) for i in range(k)], 1)
    sb = _rows(seeds, steps, 1.0)
    emitted, accepted = coupled_accept(drafts, verify_tokens(logits[None].expand(n, k + 1, vocab),
                                                             per_position(sb, k + 1)))
    for i in range(k + 1):  # plain decoding's token at output index steps + i
        assert torch.equal(emitted[:, i], sample(logits[i].expand(n, vocab), _rows(seeds, steps + i, 1.0)))
    stat, dof = _chi2(torch.bincount(emitted[:, 0], minlength=vocab), p[0])
    assert stat < _chi2_crit(dof), stat
    sel = accepted >= 1
    stat, dof = _chi2(torch.bincount(emitted[sel, 1], minlength=vocab), p[1])
    assert stat < _chi2_crit(dof), stat
    rate = sel.float().mean().item()
    if point_mass:
        assert abs(rate - p[0, 2].item()) < 0.01
    else:
        overlap = torch.minimum(p[0], q[0]).sum().item()  # 1 - TV
        assert overlap / (2 - overlap) - 0.01 < rate < overlap + 0.01
    assert torch.equal(accepted, (drafts == emitted[:, :k]).long().cumprod(1).sum(1))


def test_greedy_rows_accept_the_longest_argmax_prefix():
    """The same rule on greedy rows: each position's token is the argmax, the drafts accepted up to the first that
    differs from it; a batch mixing greedy and sampled rows gives each row its own kind of token."""
    g = torch.Generator().manual_seed(1)
    n, k, vocab = 64, 3, 5
    logits = torch.randn(n, k + 1, vocab, generator=g)
    best = logits.argmax(-1)
    drafts = best[:, :k].clone()
    cut = torch.randint(0, k + 1, (n,), generator=g)  # the first wrong draft (k: none)
    rows = torch.arange(n)[cut < k]
    drafts[rows, cut[cut < k]] = (drafts[rows, cut[cut < k]] + 1) % vocab
    seeds, steps = torch.arange(n), torch.zeros(n, dtype=torch.long)
    emitted, accepted = coupled_accept(drafts, verify_tokens(logits, per_position(_rows(seeds, steps, 0), k + 1)))
    assert torch.equal(emitted, best) and torch.equal(accepted, cut)
    mixed = _rows(seeds, steps, 1.0)
    mixed.temperatures[::2] = 0
    mixed.any_greedy = True
    tokens = verify_tokens(logits, per_position(mixed, k + 1))
    assert torch.equal(tokens[::2], best[::2])
    for i in range(k + 1):
        assert torch.equal(tokens[1::2, i], sample(logits[1::2, i], _rows(seeds[1::2], steps[1::2] + i, 1.0)))


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


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_seeded_requests_get_plain_decodings_tokens_whatever_the_steps(tiny_vocab_ckpt, method):
    """Under speculation a seeded sampled request (top-k, top-p, penalties) emits the very tokens plain decoding
    gives it alone: with the kinds of steps alternating (as the adaptive policy mixes them), other requests
    arriving while it runs, and preemptions by a small KV pool that make it compute its tokens again as a prefill."""
    from hylo.engine.spec_policy import StepChoice

    prompts = [[1, 5, 2, 7, 3], [6, 1, 4], [2, 2, 3, 1, 0, 7, 5], [4, 4]]
    params = [SamplingParams(max_tokens=20, temperature=t, top_p=top_p, seed=s, ignore_eos=True, **more)
              for t, top_p, s, more in ((1.0, 1.0, 5, {}), (0.7, 0.9, 9, {"top_k": 5}),
                                        (1.3, 1.0, 11, {"frequency_penalty": 0.4, "repetition_penalty": 1.3}),
                                        (0.5, 1.0, 2 ** 40, {"presence_penalty": 0.8}))]
    want = []
    for p, sp in zip(prompts, params):
        eng = spec_engine(tiny_vocab_ckpt, chunk_size=4)
        want.append(run_all(eng, [p], sp)[0].token_ids)
    eng = spec_engine(tiny_vocab_ckpt, method, chunk_size=4, max_num_seqs=3, kv_cache_tokens=64, max_model_len=48)
    calls = iter(range(10 ** 9))
    eng.scheduler.policy.choose = lambda reqs: StepChoice(next(calls) % 3 != 1 and all(r.has_drafts for r in reqs),
                                                         True)
    rids = []
    for p, sp in zip(prompts, params):  # each arrives while the ones before it run
        rids.append(eng.add_request(p, sp))
        for _ in range(3):
            eng.step()
    while eng.has_unfinished():
        eng.step()
    outs = [eng.pop_finished(r) for r in rids]
    assert [o.token_ids for o in outs] == want
    assert sum(o.num_preemptions for o in outs) > 0
    assert sum(o.spec.accepted_tokens for o in outs) >= 3 and sum(o.spec.plain_steps for o in outs) > 5
