"""Sampling: greedy, seeded draws that do not depend on the batch, and the sampled distribution itself."""

import torch

from hylo.core import SamplingBatch
from hylo.ops.sampling import filter_probs, sample, uniform_noise


def _sb(n, temp=1.0, top_p=1.0, top_k=None, vocab=8, seeds=None, steps=None):
    return SamplingBatch(
        temperatures=torch.full((n,), temp), top_p=torch.full((n,), top_p),
        top_k=torch.full((n,), top_k or vocab, dtype=torch.int64),
        seeds=torch.tensor(seeds if seeds is not None else list(range(n)), dtype=torch.int64),
        steps=torch.tensor(steps if steps is not None else [0] * n, dtype=torch.int64),
        all_greedy=temp == 0, any_greedy=temp == 0, need_top_k=top_k is not None, need_top_p=top_p < 1)


# chi-square critical values at p = 0.001
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 5: 20.52, 7: 24.32}


def _chi2(counts, probs):
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    return (((counts[keep] - expected) ** 2) / expected).sum().item(), int(keep.sum()) - 1


def test_noise_is_uniform_and_a_pure_function_of_seed_and_step():
    seeds = torch.arange(4000, dtype=torch.int64) * 7919 - 2 ** 40
    steps = torch.arange(4000, dtype=torch.int64) % 13
    u = uniform_noise(seeds, steps, 16)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    counts = torch.histc(u.flatten(), bins=10, min=0, max=1)
    assert _chi2(counts, torch.full((10,), 0.1))[0] < 27.9  # dof 9
    assert torch.equal(u, uniform_noise(seeds, steps, 16))
    assert not torch.equal(u[:, 0], uniform_noise(seeds, steps + 1, 16)[:, 0])


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, _sb(5, temp=0, vocab=50)), logits.argmax(-1))


def test_sampled_distribution_matches_softmax():
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5]]).repeat(n, 1)
    for temp in (1.0, 0.7):
        tokens = sample(logits, _sb(n, temp=temp, seeds=list(range(n))))
        counts = torch.bincount(tokens, minlength=8).double()
        stat, dof = _chi2(counts, torch.softmax(logits[0].double() / temp, -1))
        assert stat < _CHI2_999[dof], stat


def test_top_k_and_top_p_restrict_and_renormalise():
    n = 20000
    probs = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2])
    logits = probs.log()[None].repeat(n, 1)
    tokens = sample(logits, _sb(n, top_k=2, vocab=5, seeds=[s * 3 + 1 for s in range(n)]))
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[[0, 2, 4]].sum() == 0
    stat, dof = _chi2(counts, torch.tensor([0, 0.4, 0, 0.25, 0]).double() / 0.65)
    assert stat < _CHI2_999[dof]
    # top_p = 0.6: sorted 0.4, 0.25 reach 0.65 >= 0.6, so {1, 3} are kept
    tokens = sample(logits, _sb(n, top_p=0.6, vocab=5, seeds=[s * 5 + 2 for s in range(n)]))
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[[0, 2, 4]].sum() == 0
    kept = filter_probs(probs[None], None, torch.tensor([0.6]))[0]
    assert torch.allclose(kept, torch.tensor([0, 0.4, 0, 0.25, 0]) / 0.65)
    # top_p smaller than the largest probability keeps exactly that one
    assert torch.equal(filter_probs(probs[None], None, torch.tensor([0.1]))[0], torch.tensor([0, 1.0, 0, 0, 0]))


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(4, 30)
    sb = _sb(4, vocab=30)
    sb.temperatures = torch.tensor([0.0, 1.0, 0.0, 1.0])
    sb.any_greedy, sb.all_greedy = True, False
    out = sample(logits, sb)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    # the sampled rows equal what they give in a batch of their own
    solo = sample(logits[[1, 3]], _sb(2, vocab=30, seeds=[1, 3]))
    assert torch.equal(out[[1, 3]], solo)
