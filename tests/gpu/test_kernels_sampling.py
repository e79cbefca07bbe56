"""The fused Triton draw against the torch form: the same noise bit for bit, the same tokens."""

import pytest
import torch

from hylo.ops.sampling import draw_ref, noise_keys


@pytest.mark.parametrize("batch,vocab", [(3, 5000), (1, 2049), (6, 100)])
def test_fused_draw_equals_the_torch_draw(dev, batch, vocab):
    from hylo.ops.sampling_triton import draw_triton

    g = torch.Generator().manual_seed(vocab)
    # seeds across the whole int64 range (negative ones too), steps far apart, several streams
    seeds = torch.randint(-2 ** 62, 2 ** 62, (batch,), generator=g)
    steps = torch.randint(0, 10 ** 6, (batch,), generator=g)
    for stream in (0, 3):
        # flat probabilities: the draw is the column of the largest noise, so any difference in the hash shows
        flat = torch.full((batch, vocab), 1.0 / vocab)
        keys = noise_keys(seeds, steps, stream)
        got = draw_triton(flat.to(dev), keys.to(dev)).cpu()
        assert torch.equal(got, draw_ref(flat, seeds, steps, stream))
        # peaked random distributions, one row a point mass
        probs = torch.softmax(torch.randn(batch, vocab, generator=g) * 3, -1)
        probs[0] = 0
        probs[0, vocab // 2] = 1
        got = draw_triton(probs.to(dev), keys.to(dev)).cpu()
        assert torch.equal(got, draw_ref(probs, seeds, steps, stream))
        assert got[0] == vocab // 2
