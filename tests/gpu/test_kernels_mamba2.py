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
        # the engine's form: y stored in the activations' dtype, the float32 result rounded once at the store
        y16 = mamba2_steps(xbc.to(dev), dt.to(dev), *args, p, slots.to(dev), heads, head_dim, groups, state, steps,
                           verify, out_dtype=torch.bfloat16)
        assert y16.dtype == torch.bfloat16
        want16 = y.to(torch.bfloat16)
        if dev.type == "cuda":
            assert torch.equal(y16, want16)
        else:  # Triton's interpreter casts to bfloat16 by truncation: within one unit of the last place
            assert torch.allclose(y16.float(), want16.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("heads,head_dim,groups,state", [(6, 5, 3, 7), (4, 64, 1, 128), (8, 40, 2, 16)])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.3, 2.0)])
@pytest.mark.parametrize("segment", [None, 32, 32 * 10 ** 4])
def test_mamba2_scan_matches_the_reference(dev, heads, head_dim, groups, state, limit, segment):
    """A varlen prefill: rows longer than a chunk, shorter than one, of one token, a padded row (-1: from zeros,
    nothing written); each from its slot's state to its slot; the dt clamp where the config has one, except on the
    rows marked unclamped (decoding rows riding along; one of them long enough to be cut). Rows cut into segments as
    the engine cuts them (None), into segments of one chunk each, and whole."""
    from hylo.ops.mamba2_scan_triton import ScanPlan, channel_block, mamba2_scan

    g = torch.Generator().manual_seed(heads + int(limit[0] * 10))
    lens = [150, 9, 1, 20, 97]
    slots = torch.tensor([3, 1, 5, -1, 6])
    unclamped = [False, False, True, False, True]
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * state
    T = sum(lens)
    xbc = torch.randn(T, conv_dim, generator=g)
    dt = torch.randn(T, heads, generator=g)
    A_log, D, dt_bias = (torch.randn(heads, generator=g) for _ in range(3))
    pool = torch.randn(8, heads, head_dim, state, generator=g)
    qsl = torch.tensor([0] + lens).cumsum(0)
    A = -torch.exp(A_log)
    want_y, want_pool = [], pool.clone()
    for i, n in enumerate(lens):
        sl = slice(int(qsl[i]), int(qsl[i + 1]))
        x = xbc[sl, :inner].reshape(n, heads, head_dim)
        B = xbc[sl, inner:inner + groups * state].reshape(n, groups, state)
        C = xbc[sl, inner + groups * state:].reshape(n, groups, state)
        s = int(slots[i])
        y, final = ref.ssd_chunk_scan_ref(x, ref.discretize(dt[sl], dt_bias, None if unclamped[i] else limit), A,
                                          B, C, D,
                                          pool[s] if s >= 0 else None, chunk_size=16)
        want_y.append(y)
        if s >= 0:
            want_pool[s] = final
    dpool = pool.to(dev)
    plan = ScanPlan.build(lens, dev, heads * -(-head_dim // channel_block(head_dim)), 32,
                          segment, unclamped=unclamped)
    if segment is None:  # the engine's cut: here (few programs per segment) every long row is cut
        assert plan.num_segments > len(lens) and plan.num_inner == plan.num_segments - len(lens)
    out = mamba2_scan(xbc.to(dev), dt.to(dev), A_log.to(dev), D.to(dev), dt_bias.to(dev), dpool, slots.to(dev),
                      plan, heads, head_dim, groups, state, limit, chunk=32)
    assert torch.allclose(out.cpu(), torch.cat(want_y), atol=2e-4, rtol=2e-4)
    assert torch.allclose(dpool.cpu(), want_pool, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("channels,groups", [(30, 3), (512, 1), (96, 8)])
@pytest.mark.parametrize("gate_first", [True, False])
def test_gated_group_norm_matches_the_references(dev, channels, groups, gate_first):
    """Mamba2's output norm, both orders, the gate read in place from a wider projection row."""
    from hylo.ops.mamba2_triton import gated_group_norm

    g = torch.Generator().manual_seed(channels)
    y = torch.randn(5, channels, generator=g)
    proj = torch.randn(5, 2 * channels + 3, generator=g)
    z = proj[:, channels + 3:]
    w = torch.randn(channels, generator=g)
    fn = ref.gate_then_norm_ref if gate_first else ref.norm_then_gate_ref
    want = fn(y, z, w, channels // groups, 1e-5)
    out = gated_group_norm(y.to(dev), z.to(dev), w.to(dev), groups, 1e-5, gate_first, torch.float32)
    assert torch.allclose(out.cpu(), want, atol=1e-5, rtol=1e-5)


def test_plain_rms_norm_kernel_matches_the_reference(dev):
    from hylo.ops.norm_triton import rms_norm_triton

    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(7, 96, generator=g), torch.randn(96, generator=g)
    out = rms_norm_triton(x.to(dev), w.to(dev), 1e-5, plain=True)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w  # (the reference's own path is Triton here)
    assert torch.allclose(out.cpu(), want, atol=1e-5, rtol=1e-5)
