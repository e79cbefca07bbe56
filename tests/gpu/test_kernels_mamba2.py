"""Mamba2's decode and verify kernel against the torch references (``ops.mamba2``): slots read and written in
place, a padded row (-1) that writes nothing, every step's state kept by a verify that leaves the slots alone;
odd sizes (several groups, head dims and state sizes that are not powers of two) and a head over several blocks."""

import pytest
import torch

from hylo.ops import mamba2 as ref


@pytest.mark.parametrize("heads,head_dim,groups,state", [(6, 5, 3, 7), (4, 64, 1, 128), (8, 40, 2, 16)])
@pytest.mark.parametrize("steps", [1, 4])
def test_mamba2_steps_match_the_references(dev, heads, head_dim, groups, state, steps):
    from hylo.ops.mamba2_triton import mamba2_steps

    g = torch.Generator().manual_seed(heads * steps)
    batch, slots_n = 3, 6
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * state
    xbc = torch.randn(batch * steps, conv_dim + 5, generator=g)[:, :conv_dim]  # rows strided, as a slice is
    dt = torch.randn(batch * steps, heads, generator=g)
    A_log, D, dt_bias = (torch.randn(heads, generator=g) for _ in range(3))
    pool = torch.randn(slots_n, heads, head_dim, state, generator=g)
    slots = torch.tensor([4, -1, 2])
    x, B, C = (t.reshape(batch, steps, *shape) for t, shape in (
        (xbc[:, :inner], (heads, head_dim)), (xbc[:, inner:inner + groups * state], (groups, state)),
        (xbc[:, inner + groups * state:], (groups, state))))
    dtd = ref.discretize(dt, dt_bias).view(batch, steps, heads)
    A = -torch.exp(A_log)
    state0 = pool[slots.clamp(min=0)] * (slots >= 0)[:, None, None, None]
    want_y, want_states = ref.ssd_verify_ref(x, dtd, A, B, C, D, state0)
    args = (A_log.to(dev), D.to(dev), dt_bias.to(dev))
    if steps == 1:
        p = pool.to(dev)
        y = mamba2_steps(xbc.to(dev), dt.to(dev), *args, p, slots.to(dev), heads, head_dim, groups, state)
        assert torch.allclose(y.cpu().view(batch, 1, heads, head_dim)[[0, 2]], want_y[[0, 2]], atol=1e-4, rtol=1e-4)
        p = p.cpu()
        assert torch.allclose(p[4], want_states[0, 0], atol=1e-4) and torch.allclose(p[2], want_states[2, 0], atol=1e-4)
        untouched = [0, 1, 3, 5]
        assert torch.equal(p[untouched], pool[untouched])
    else:
        p = pool.to(dev)
        verify = torch.full((4, steps, heads, head_dim, state), float("nan"), device=dev)
        y = mamba2_steps(xbc.to(dev), dt.to(dev), *args, p, slots.to(dev), heads, head_dim, groups, state, steps,
                         verify)
        assert torch.equal(p.cpu(), pool)  # a verify writes no slot
        assert torch.allclose(y.cpu().view(batch, steps, heads, head_dim), want_y, atol=1e-4, rtol=1e-4)
        assert torch.allclose(verify[:batch].cpu(), want_states, atol=1e-4, rtol=1e-4)
