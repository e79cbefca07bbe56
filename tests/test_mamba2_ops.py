"""Mamba2's reference ops against transformers' own torch implementation (NemotronH's: the chunked scan with an
initial state and a dt limit, the single-step state update, the conv with bias, the grouped gated RMSNorm), on
shapes with several groups and sizes that are not powers of two."""

import pytest
import torch
import torch.nn.functional as F

from hylo.ops import conv1d, mamba2

hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")


def _inputs(g, length, heads=6, head_dim=5, groups=3, state=7):
    x = torch.randn(length, heads, head_dim, generator=g)
    dt_raw = torch.randn(length, heads, generator=g) * 2 - 3  # some softplus values below the dt limit
    A = -torch.exp(torch.randn(heads, generator=g))
    B = torch.randn(length, groups, state, generator=g)
    C = torch.randn(length, groups, state, generator=g)
    D = torch.randn(heads, generator=g)
    dt_bias = torch.randn(heads, generator=g)
    return x, dt_raw, A, B, C, D, dt_bias


@pytest.mark.parametrize("length,chunk,hf_chunk", [(1, 4, 8), (13, 4, 8), (40, 16, 6), (9, 128, 128)])
def test_chunk_scan_matches_transformers(length, chunk, hf_chunk):
    """Our chunks and transformers' cut the sequence at different places: the result is the recurrence's."""
    g = torch.Generator().manual_seed(length)
    x, dt_raw, A, B, C, D, dt_bias = _inputs(g, length)
    init = torch.randn(6, 5, 7, generator=g)
    limit = (0.05, float("inf"))
    want, want_state = hf.mamba2_chunk_scan(x[None], dt_raw[None], A, B[None], C[None], chunk_size=hf_chunk, D=D,
                                            dt_bias=dt_bias, initial_states=init[None], dt_softplus=True,
                                            dt_limit=limit, return_final_states=True)
    dt = mamba2.discretize(dt_raw, dt_bias, limit)
    assert (F.softplus(dt_raw + dt_bias) < limit[0]).any()  # the clamp is exercised
    y, state = mamba2.ssd_chunk_scan_ref(x, dt, A, B, C, D, init, chunk_size=chunk)
    assert torch.allclose(y, want[0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(state, want_state[0], atol=1e-4, rtol=1e-4)
    # the state continues exactly across a split sequence (prefill chunks of the engine)
    cut = length // 2
    y1, s1 = mamba2.ssd_chunk_scan_ref(x[:cut], dt[:cut], A, B[:cut], C[:cut], D, init, chunk_size=chunk)
    y2, s2 = mamba2.ssd_chunk_scan_ref(x[cut:], dt[cut:], A, B[cut:], C[cut:], D, s1, chunk_size=chunk)
    assert torch.allclose(torch.cat([y1, y2]), y, atol=1e-5, rtol=1e-5)
    assert torch.allclose(s2, state, atol=1e-5, rtol=1e-5)


def test_step_decode_and_verify_match_transformers_state_update():
    g = torch.Generator().manual_seed(3)
    b, steps, heads, head_dim, groups, n = 3, 4, 6, 5, 3, 7
    x, dt_raw, A, B, C, D, dt_bias = (t.view(b, steps, *t.shape[1:]) if t.dim() > 1 and t.shape[0] == b * steps
                                      else t for t in _inputs(g, b * steps, heads, head_dim, groups, n))
    state0 = torch.randn(b, heads, head_dim, n, generator=g)
    # transformers' update, step by step (no dt limit in the decode step, as in the released kernels)
    hf_state, hf_out = state0.clone(), []
    for s in range(steps):
        hf_out.append(hf.mamba2_selective_state_update(
            hf_state, x[:, s], dt_raw[:, s, :, None].expand(-1, -1, head_dim),
            A[:, None, None].expand(-1, head_dim, n), B[:, s], C[:, s], D[:, None].expand(-1, head_dim),
            dt_bias=dt_bias[:, None].expand(-1, head_dim), dt_softplus=True))
    dt = mamba2.discretize(dt_raw, dt_bias)
    y, states = mamba2.ssd_verify_ref(x, dt, A, B, C, D, state0)
    assert torch.allclose(y, torch.stack(hf_out, 1), atol=1e-5, rtol=1e-5)
    assert torch.allclose(states[:, -1], hf_state, atol=1e-5, rtol=1e-5)
    # decode in place by slot: a padded row (-1) reads zeros and writes nothing
    pool = torch.zeros(6, heads, head_dim, n)
    pool[[4, 1, 2]] = state0
    before = pool.clone()
    slots = torch.tensor([4, -1, 2])
    out = mamba2.ssd_decode_ref(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, pool, slots)
    assert torch.allclose(out[[0, 2]], y[[0, 2], 0], atol=1e-6)
    assert torch.allclose(pool[4], states[0, 0]) and torch.allclose(pool[2], states[2, 0])
    assert torch.equal(pool[1], before[1]) and torch.equal(pool[0], before[0])
    # the chunked prefill of the same tokens ends in the same state (no dt limit: none below it here)
    y_p, s_p = mamba2.ssd_chunk_scan_ref(x[0], dt[0], A, B[0], C[0], D, state0[0], chunk_size=3)
    assert torch.allclose(y_p, y[0], atol=1e-5) and torch.allclose(s_p, states[0, -1], atol=1e-5)


def test_conv_with_bias_and_gated_norm_match_transformers():
    g = torch.Generator().manual_seed(4)
    channels, k, length = 11, 4, 9
    x = torch.randn(length, channels, generator=g)
    w = torch.randn(channels, k, generator=g)
    bias = torch.randn(channels, generator=g)
    want = hf.causal_conv1d_fn(x.t()[None], w, bias, activation="silu")[0].t()
    out, state = conv1d.causal_conv1d_ref(x, None, w, bias)
    assert torch.allclose(out, want, atol=1e-5)
    # one more token by slot, and the verify windows, continue it
    nxt = torch.randn(2, channels, generator=g)
    pool = torch.zeros(3, channels, k - 1)
    pool[2] = state
    step = conv1d.causal_conv1d_update_ref(nxt[:1], pool, w, torch.tensor([2]), bias)
    full = hf.causal_conv1d_fn(torch.cat([x, nxt[:1]]).t()[None], w, bias, activation="silu")[0].t()
    assert torch.allclose(step[0], full[-1], atol=1e-5)
    win, _ = conv1d.causal_conv1d_windows_ref(nxt[None], state[None], w, bias)
    full2 = hf.causal_conv1d_fn(torch.cat([x, nxt]).t()[None], w, bias, activation="silu")[0].t()
    assert torch.allclose(win[0], full2[-2:], atol=1e-5)
    # the grouped gated norm
    size, groups = 12, 3
    norm = hf.NemotronHRMSNormGated(size, group_size=size // groups, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=g))
    y, z = torch.randn(5, size, generator=g), torch.randn(5, size, generator=g)
    got = mamba2.gate_then_norm_ref(y, z, norm.weight.detach(), size // groups, 1e-5)
    assert torch.allclose(got, norm(y, z).detach(), atol=1e-6)
