"""The fused Triton draw against the torch form: the same noise bit for bit, the same tokens."""

import pytest
import torch

from hylo.ops.sampling import draw_ref


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
        sd, st = seeds.to(dev), steps.to(dev)
        got = draw_triton(flat.to(dev), sd, st, stream).cpu()
        assert torch.equal(got, draw_ref(flat, seeds, steps, stream))
        # peaked random distributions, one row a point mass
        probs = torch.softmax(torch.randn(batch, vocab, generator=g) * 3, -1)
        probs[0] = 0
        probs[0, vocab // 2] = 1
        got = draw_triton(probs.to(dev), sd, st, stream).cpu()
        assert torch.equal(got, draw_ref(probs, seeds, steps, stream))
        assert got[0] == vocab // 2


@pytest.mark.parametrize("width", [1, 3, 40])
def test_noise_kernel_equals_the_torch_noise(dev, width):
    """The one-launch noise of acceptance tests: the same bits as the torch form, for any seed and stream."""
    from hylo.ops.sampling import uniform_noise_ref
    from hylo.ops.sampling_triton import uniform_noise_triton

    g = torch.Generator().manual_seed(width)
    seeds = torch.randint(-2 ** 62, 2 ** 62, (7,), generator=g)
    steps = torch.randint(0, 10 ** 9, (7,), generator=g)
    for stream in (0, 1, 3):
        got = uniform_noise_triton(seeds.to(dev), steps.to(dev), width, stream).cpu()
        assert torch.equal(got, uniform_noise_ref(seeds, steps, width, stream))


def test_the_top_noise_value_stays_below_one(dev):
    """Seed 74, step 31, column 1962 draws the top 24-bit value, whose float32 (x + 0.5) / 2^24 rounded to exactly
    1 (then -log(u) = 0 and a zero probability's race value NaN, which the argmax picked): both forms clamp it to
    the largest float32 below 1, and a zero-probability token is never drawn there."""
    from hylo.ops.sampling import U_MAX, draw_ref, uniform_noise_ref
    from hylo.ops.sampling_triton import draw_triton, uniform_noise_triton

    seeds, steps = torch.tensor([74]), torch.tensor([31])
    want = uniform_noise_ref(seeds, steps, 4096)
    assert want[0, 1962] == U_MAX and bool((want < 1).all() and (want > 0).all())
    assert torch.equal(uniform_noise_triton(seeds.to(dev), steps.to(dev), 4096, 0).cpu(), want)
    probs = torch.full((1, 4096), 1.0 / 4095)
    probs[0, 1962] = 0.0
    got = draw_triton(probs.to(dev), seeds.to(dev), steps.to(dev), 0).cpu()
    assert got[0] != 1962 and torch.equal(got, draw_ref(probs, seeds, steps, 0))
