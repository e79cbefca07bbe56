"""Each op's torch reference against a plain float64 recurrence or formula."""

import math

import pytest
import torch
import torch.nn.functional as F

from hylo.ops import attention as attn_ops
from hylo.ops import conv1d, gdn, moe, norm
from hylo.ops.pair_rows import SortedPairRows

torch.manual_seed(0)


def _naive_gdn(q, k, v, g, beta, state):
    """Token-by-token float64 recurrence, written from the formula (GQA by head index arithmetic)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    S = state.double().clone()
    L, Hk, Dk = q.shape
    Hv = v.shape[1]
    rep = Hv // Hk
    out = torch.zeros(L, Hv, v.shape[-1], dtype=torch.float64)
    for t in range(L):
        for h in range(Hv):
            qt = q[t, h // rep] / q[t, h // rep].norm()
            kt = k[t, h // rep] / k[t, h // rep].norm()
            qt = qt / math.sqrt(Dk)
            decayed = math.exp(g[t, h]) * S[h]
            S[h] = decayed + torch.outer(kt, beta[t, h] * (v[t, h] - decayed.T @ kt))
            out[t, h] = S[h].T @ qt
    return out, S


@pytest.mark.parametrize("length,chunk", [(1, 64), (13, 4), (70, 16), (33, 64)])
def test_chunk_gdn_matches_recurrence(length, chunk):
    Hk, Hv, Dk, Dv = 2, 6, 12, 10
    q, k = torch.randn(length, Hk, Dk), torch.randn(length, Hk, Dk)
    v = torch.randn(length, Hv, Dv)
    g = -torch.rand(length, Hv) * 2
    beta = torch.rand(length, Hv)
    s0 = torch.randn(Hv, Dk, Dv) * 0.3
    o, s = gdn.chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk_size=chunk)
    ro, rs = _naive_gdn(q, k, v, g, beta, s0)
    assert torch.allclose(o.double(), ro, atol=1e-4, rtol=1e-4)
    assert torch.allclose(s.double(), rs, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_continues_state_exactly():
    Hk, Hv, Dk, Dv, L = 1, 2, 8, 8, 40
    q, k, v = torch.randn(L, Hk, Dk), torch.randn(L, Hk, Dk), torch.randn(L, Hv, Dv)
    g, beta = -torch.rand(L, Hv), torch.rand(L, Hv)
    o_all, s_all = gdn.chunk_gated_delta_rule_ref(q, k, v, g, beta, None)
    o1, s1 = gdn.chunk_gated_delta_rule_ref(q[:17], k[:17], v[:17], g[:17], beta[:17], None)
    o2, s2 = gdn.chunk_gated_delta_rule_ref(q[17:], k[17:], v[17:], g[17:], beta[17:], s1)
    assert torch.allclose(torch.cat([o1, o2]), o_all, atol=1e-5)
    assert torch.allclose(s2, s_all, atol=1e-5)


def test_decode_step_by_slot_matches_recurrence_and_skips_minus_one():
    Hk, Hv, Dk, Dv = 2, 4, 8, 6
    pool = torch.randn(5, Hv, Dk, Dv)
    before = pool.clone()
    slots = torch.tensor([3, -1, 1])
    q, k = torch.randn(3, Hk, Dk), torch.randn(3, Hk, Dk)
    v, g, beta = torch.randn(3, Hv, Dv), -torch.rand(3, Hv), torch.rand(3, Hv)
    out = gdn.gdn_decode_ref(q, k, v, g, beta, pool, slots)
    for row, slot in [(0, 3), (2, 1)]:
        ro, rs = _naive_gdn(q[row:row + 1], k[row:row + 1], v[row:row + 1], g[row:row + 1], beta[row:row + 1],
                            before[slot])
        assert torch.allclose(out[row].double(), ro[0], atol=1e-5)
        assert torch.allclose(pool[slot].double(), rs, atol=1e-5)
    for slot in (0, 2, 4):  # untouched: the skipped row, and slots nobody used
        assert torch.equal(pool[slot], before[slot])


def test_verify_keeps_every_step_state():
    Hk, Hv, Dk, Dv, B, S = 1, 2, 4, 4, 2, 3
    q, k = torch.randn(B, S, Hk, Dk), torch.randn(B, S, Hk, Dk)
    v, g, beta = torch.randn(B, S, Hv, Dv), -torch.rand(B, S, Hv), torch.rand(B, S, Hv)
    s0 = torch.randn(B, Hv, Dk, Dv)
    o, states = gdn.gdn_verify_ref(q, k, v, g, beta, s0)
    for b in range(B):
        for s in range(S):
            ro, rs = _naive_gdn(q[b, :s + 1], k[b, :s + 1], v[b, :s + 1], g[b, :s + 1], beta[b, :s + 1], s0[b])
            assert torch.allclose(states[b, s].double(), rs, atol=1e-5)
            assert torch.allclose(o[b, s].double(), ro[s], atol=1e-5)


def test_gating_formula():
    A_log, a, dt_bias, b = torch.randn(5), torch.randn(3, 5), torch.randn(5), torch.randn(3, 5)
    g, beta = gdn.gdn_gating(A_log, a, dt_bias, b)
    ref_g = -torch.exp(A_log.double()) * torch.log1p(torch.exp(a.double() + dt_bias.double()))
    assert torch.allclose(g.double(), ref_g, atol=1e-6)
    assert torch.allclose(beta.double(), 1 / (1 + torch.exp(-b.double())), atol=1e-7)


def _naive_conv(x, state, w):
    """float64: out[t, c] = silu(sum_j w[c, j] * window[c, t + j]) over [state | x]."""
    C, K = w.shape
    full = torch.cat([state.double(), x.double().T], dim=1)
    out = torch.zeros(x.shape[0], C, dtype=torch.float64)
    for t in range(x.shape[0]):
        s = (full[:, t:t + K] * w.double()).sum(1)
        out[t] = s / (1 + torch.exp(-s))
    return out, full[:, -(K - 1):]


@pytest.mark.parametrize("length,K", [(1, 4), (2, 4), (9, 3)])
def test_causal_conv_prefill(length, K):
    C = 7
    x, state, w = torch.randn(length, C), torch.randn(C, K - 1), torch.randn(C, K)
    out, new = conv1d.causal_conv1d_ref(x, state, w)
    ro, rs = _naive_conv(x, state, w)
    assert torch.allclose(out.double(), ro, atol=1e-5)
    assert torch.allclose(new.double(), rs, atol=1e-6)


def test_causal_conv_update_by_slot_and_windows():
    C, K = 6, 4
    pool = torch.randn(4, C, K - 1)
    before = pool.clone()
    w = torch.randn(C, K)
    x = torch.randn(3, C)
    slots = torch.tensor([2, -1, 3])
    out = conv1d.causal_conv1d_update_ref(x, pool, w, slots)
    for row, slot in [(0, 2), (2, 3)]:
        ro, rs = _naive_conv(x[row:row + 1], before[slot], w)
        assert torch.allclose(out[row].double(), ro[0], atol=1e-5)
        assert torch.allclose(pool[slot].double(), rs, atol=1e-6)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[1], before[1])
    # verify variant: every step's window, no state written
    xs = torch.randn(2, 3, C)
    st = torch.randn(2, C, K - 1)
    o, states = conv1d.causal_conv1d_windows_ref(xs, st, w)
    for b in range(2):
        ro, _ = _naive_conv(xs[b], st[b], w)
        assert torch.allclose(o[b].double(), ro, atol=1e-5)
        for s in range(3):
            _, rs = _naive_conv(xs[b, :s + 1], st[b], w)
            assert torch.allclose(states[b, s].double(), rs, atol=1e-6)


def _naive_attention(q, k, v, scaling):
    """float64, causal with the last q rows aligned to the last keys, GQA by head index."""
    Lq, H, D = q.shape
    Lk, KVH, _ = k.shape
    out = torch.zeros(Lq, H, D, dtype=torch.float64)
    for i in range(Lq):
        pos = Lk - Lq + i
        for h in range(H):
            kh = h // (H // KVH)
            s = (k[:pos + 1, kh].double() @ q[i, h].double()) * scaling
            p = torch.softmax(s, 0)
            out[i, h] = p @ v[:pos + 1, kh].double()
    return out


def test_extend_and_decode_attention_over_paged_pool():
    H, KVH, D, N = 6, 2, 20, 64
    kc, vc = torch.randn(N, KVH, D), torch.randn(N, KVH, D)
    req_to_token = torch.zeros(3, 40, dtype=torch.int64)
    perm = torch.randperm(N - 1) + 1
    req_to_token[1, :30] = perm[:30]
    req_to_token[2, :25] = perm[30:55]
    # extend: request 1 with prefix 20 + 10 new, request 2 with no prefix, 25 new
    q = torch.randn(35, H, D)
    out = attn_ops.extend_attention_ref(q, kc, vc, req_to_token, [1, 2], [20, 0], [10, 25], D ** -0.5)
    r1 = _naive_attention(q[:10], kc[req_to_token[1, :30]], vc[req_to_token[1, :30]], D ** -0.5)
    r2 = _naive_attention(q[10:], kc[req_to_token[2, :25]], vc[req_to_token[2, :25]], D ** -0.5)
    assert torch.allclose(out.double(), torch.cat([r1, r2]), atol=1e-5)
    # the prefill path of the GPU backend (torch's fused attention; on the CPU with the K/V heads repeated)
    sdpa = attn_ops.extend_attention_sdpa(q, kc, vc, req_to_token, [1, 2], [20, 0], [10, 25], D ** -0.5)
    assert torch.allclose(sdpa.double(), torch.cat([r1, r2]), atol=1e-5)
    # decode/verify with 2 queries per row, host upper bound larger than every length
    qd = torch.randn(4, H, D)
    seq_lens = torch.tensor([30, 25])
    od = attn_ops.decode_attention_ref(qd, kc, vc, req_to_token, torch.tensor([1, 2]), seq_lens, 40, D ** -0.5,
                                       tokens_per_row=2)
    d1 = _naive_attention(qd[:2], kc[req_to_token[1, :30]], vc[req_to_token[1, :30]], D ** -0.5)
    d2 = _naive_attention(qd[2:], kc[req_to_token[2, :25]], vc[req_to_token[2, :25]], D ** -0.5)
    assert torch.allclose(od.double(), torch.cat([d1, d2]), atol=1e-5)


def test_norms():
    x, w, gate = torch.randn(5, 16), torch.randn(16), torch.randn(5, 16)
    xd = x.double()
    rms = xd / torch.sqrt((xd ** 2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(norm.rms_norm(x, w, 1e-6).double(), rms * (1 + w.double()), atol=1e-6)
    silu = gate.double() / (1 + torch.exp(-gate.double()))
    assert torch.allclose(norm.gated_rms_norm(x, gate, w, 1e-6).double(), rms * w.double() * silu, atol=1e-6)


def test_moe_matches_per_token_loop():
    T, H, I, E, k = 9, 12, 8, 5, 2
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    logits = torch.randn(T, E)
    for normalize in (True, False):
        weights, ids = moe.route_topk(logits, k, normalize)
        p = torch.softmax(logits.double(), -1)
        top = p.topk(k, -1)
        ref_w = top.values / top.values.sum(-1, keepdim=True) if normalize else top.values
        assert torch.equal(ids, top.indices)
        assert torch.allclose(weights.double(), ref_w, atol=1e-6)
        out = moe.fused_moe_ref(x, w13, w2, weights, ids)
        ref = torch.zeros(T, H, dtype=torch.float64)
        for t in range(T):
            for j in range(k):
                e = ids[t, j]
                h = w13[e].double() @ x[t].double()
                a = F.silu(h[:I]) * h[I:]
                ref[t] += weights[t, j].double() * (w2[e].double() @ a)
        assert torch.allclose(out.double(), ref, atol=1e-4)


def test_residual_add_sums_unreduced_rows_in_float32():
    """add_rms_norm with a [T, J, H] delta (MoE pair rows, split-K partials) equals the add of their sum."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    parts = torch.randn(3, 5, 16, generator=g)
    w = torch.randn(16, generator=g)
    res, y = norm.add_rms_norm(x, parts, w, 1e-6)
    want = (x.double() + parts.double().sum(1)).to(torch.bfloat16)
    assert res.dtype == torch.bfloat16 and torch.equal(res, want)
    assert torch.allclose(y.float(), norm.rms_norm_ref(want, w, 1e-6).float())


def test_residual_add_sums_pair_rows_left_in_expert_order():
    """A MoE output left as its pairs' rows in expert order (``SortedPairRows``, the grouped-GEMM path's): reduced,
    each token gets the weighted sum of its own k rows; the residual add-norm takes it as it takes the sums."""
    g = torch.Generator().manual_seed(23)
    T, k, H = 5, 3, 16
    ys = torch.randn(T * k, H, generator=g).to(torch.bfloat16)
    pos = torch.randperm(T * k, generator=g)
    weights = torch.rand(T * k, generator=g).to(torch.bfloat16)
    pairs = SortedPairRows(ys, pos, weights, k)
    want = torch.stack([sum(weights[t * k + j].double() * ys[pos[t * k + j]].double() for j in range(k))
                        for t in range(T)])
    summed = pairs.reduce()
    assert summed.shape == (T, 1, H) and summed.dtype == torch.float32
    assert torch.allclose(summed[:, 0].double(), want, atol=1e-5)
    x, w = torch.randn(T, H, generator=g).to(torch.bfloat16), torch.randn(H, generator=g)
    res, y = norm.add_rms_norm(x, pairs, w, 1e-6)
    res2, y2 = norm.add_rms_norm(x, summed, w, 1e-6)
    assert torch.equal(res, res2) and torch.equal(y, y2)
    assert not torch.equal(res, x)


def test_output_projections_on_the_cpu_are_the_unfused_ops():
    """The mixers' projection helpers (ops.linear) and the attention's output gate run plain torch off CUDA."""
    from hylo.ops import linear

    g = torch.Generator().manual_seed(22)
    x, gate = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    w, b, nw = torch.randn(5, 16, generator=g), torch.randn(5, generator=g), torch.randn(8, generator=g)
    flat, gflat = x.reshape(4, 16), gate.reshape(4, 16)
    assert torch.allclose(linear.dense(flat, w), flat @ w.T)
    assert torch.allclose(linear.out_proj(flat, w, b, reduce=False), F.linear(flat, w, b))
    from hylo.ops.attention import output_gate

    assert torch.equal(output_gate(x, gflat), (flat * torch.sigmoid(gflat)).view(4, 2, 8))
    assert torch.allclose(linear.norm_out_proj(x, gate, nw, 1e-6, w, reduce=False),
                          F.linear(norm.gated_rms_norm(x, gate, nw, 1e-6).reshape(4, 16), w))


def test_prefill_index_of_the_gdn_backend():
    """The per-forward index tensors of a prefill: token rows, slot gathers with -1 rows masked, and the rows
    whose final states are written back; host offsets equal to the device ones."""
    from hylo.backends.gdn import PrefillIndex

    ix = PrefillIndex.build([3, -1, 0], [2, 1, 3], torch.device("cpu"))
    assert ix.token_row.tolist() == [0, 0, 1, 2, 2, 2]
    assert ix.slot_or_zero.tolist() == [3, 0, 0] and ix.has_slot.tolist() == [True, False, True]
    assert ix.kept_rows.tolist() == [0, 2] and ix.kept_slots.tolist() == [3, 0]
    assert ix.cu_seqlens.tolist() == ix.cu_seqlens_cpu.tolist() == [0, 2, 3, 6]


def test_route_takes_split_partials_of_the_logits():
    """The router GEMV's split-K partials [T, S, E + 1] route as their sum rounded to the model's dtype."""
    g = torch.Generator().manual_seed(8)
    partials = torch.randn(5, 4, 9, generator=g)
    w, ids = moe.route(partials, 8, 3, True, True, torch.bfloat16)
    rw, rids = moe.route(partials.sum(1).to(torch.bfloat16), 8, 3, True, True)
    assert w.dtype == torch.bfloat16 and torch.equal(ids, rids) and torch.equal(w, rw)
    assert (ids[:, 3] == 8).all()


def test_row_aligned_router_weight_is_made_once_and_remade_after_an_in_place_change():
    """``narrow``'s zero-padded copy of a 65-row weight (cuBLAS's aligned kernels on CUDA) is cached per weight."""
    from hylo.ops.linear import _row_aligned

    w = torch.nn.Parameter(torch.randn(65, 16), requires_grad=False)
    a = _row_aligned(w)
    assert _row_aligned(w) is a
    assert a.shape == (72, 16) and torch.equal(a[:65], w) and not a[65:].any()
    with torch.no_grad():
        w.mul_(2.0)
    b = _row_aligned(w)
    assert b is not a and torch.equal(b[:65], w)


def test_kernel_settings_from_the_environment_name_a_bad_value(monkeypatch):
    """Launch configurations a benchmark takes from a sweep (``HYLO_GDN_*_CFG`` and the like): parsed, or refused
    with the variable named."""
    from hylo.ops.triton_utils import env_cfg

    monkeypatch.delenv("HYLO_TEST_CFG", raising=False)
    assert env_cfg("HYLO_TEST_CFG", (32, 4)) == (32, 4)
    monkeypatch.setenv("HYLO_TEST_CFG", "64,8")
    assert env_cfg("HYLO_TEST_CFG", (32, 4)) == (64, 8)
    for bad in ("64", "64,0", "a,b", "64,8,2"):
        monkeypatch.setenv("HYLO_TEST_CFG", bad)
        with pytest.raises(ValueError, match="HYLO_TEST_CFG"):
            env_cfg("HYLO_TEST_CFG", (32, 4))


def test_on_off_settings_from_the_environment_name_a_bad_value(monkeypatch):
    """On/off settings (``HYLO_PDL``, ``HYLO_GEMV_FMA``, ...): "1" or "0", the default when unset; anything else is
    refused with the variable named instead of quietly meaning off."""
    from hylo.ops.triton_utils import env_flag

    monkeypatch.delenv("HYLO_TEST_FLAG", raising=False)
    assert env_flag("HYLO_TEST_FLAG", True) is True and env_flag("HYLO_TEST_FLAG", False) is False
    monkeypatch.setenv("HYLO_TEST_FLAG", "0")
    assert env_flag("HYLO_TEST_FLAG", True) is False
    monkeypatch.setenv("HYLO_TEST_FLAG", "1")
    assert env_flag("HYLO_TEST_FLAG", False) is True
    for bad in ("yes", "true", "", "2"):
        monkeypatch.setenv("HYLO_TEST_FLAG", bad)
        with pytest.raises(ValueError, match="HYLO_TEST_FLAG"):
            env_flag("HYLO_TEST_FLAG", True)


def test_kind_lists_from_the_environment_name_a_bad_entry(monkeypatch):
    """Settings that name kinds (``HYLO_EARLY_LOADS``: gdn, conv): a comma list, 1 for all, 0 or empty for none,
    the default when unset; an unknown name (``gemv``, taken out in session 20) is refused with the variable
    named."""
    from hylo.ops.triton_utils import env_kinds

    kinds = ("gdn", "conv")
    monkeypatch.delenv("HYLO_TEST_KINDS", raising=False)
    assert env_kinds("HYLO_TEST_KINDS", kinds, "gdn") == {"gdn"}
    for text, want in (("0", set()), ("", set()), ("1", {"gdn", "conv"}), ("conv, gdn", {"gdn", "conv"}),
                       ("conv", {"conv"})):
        monkeypatch.setenv("HYLO_TEST_KINDS", text)
        assert env_kinds("HYLO_TEST_KINDS", kinds, "gdn") == want, text
    for bad in ("gdn,down", "gemv"):
        monkeypatch.setenv("HYLO_TEST_KINDS", bad)
        with pytest.raises(ValueError, match="HYLO_TEST_KINDS.*unknown.*'(down|gemv)'"):
            env_kinds("HYLO_TEST_KINDS", kinds, "gdn")


def test_integer_settings_from_the_environment_name_a_bad_value(monkeypatch):
    """Integer settings (``HYLO_GEMV_NORM_BK``, ``HYLO_GROUPED_MM_MIN_PAIRS``, ...): the default when unset, the value
    when it is an integer at or above the minimum, else refused with the variable named."""
    from hylo.ops.triton_utils import env_int

    monkeypatch.delenv("HYLO_TEST_INT", raising=False)
    assert env_int("HYLO_TEST_INT", 512) == 512
    monkeypatch.setenv("HYLO_TEST_INT", "0")
    assert env_int("HYLO_TEST_INT", 512, minimum=0) == 0
    for bad, minimum in (("0", 1), ("-3", 0), ("12.5", 1), ("many", 0), ("", 1)):
        monkeypatch.setenv("HYLO_TEST_INT", bad)
        with pytest.raises(ValueError, match="HYLO_TEST_INT"):
            env_int("HYLO_TEST_INT", 512, minimum=minimum)


def test_prefill_index_fields():
    """The GDN prefill's index tensors (built on the host, copied to the device in one piece): each token's row,
    the slots to start from and end in (rows without a slot start from zeros and keep nothing), the token offsets
    and fla's (row, chunk) pairs."""
    from hylo.backends.gdn import FLA_CHUNK, PrefillIndex

    slots, lens = [4, -1, 2], [3, FLA_CHUNK + 1, 2 * FLA_CHUNK]
    ix = PrefillIndex.build(slots, lens, "cpu")
    assert ix.token_row.tolist() == [0] * 3 + [1] * (FLA_CHUNK + 1) + [2] * (2 * FLA_CHUNK)
    assert ix.slot_or_zero.tolist() == [4, 0, 2] and ix.has_slot.tolist() == [1, 0, 1]
    assert ix.kept_rows.tolist() == [0, 2] and ix.kept_slots.tolist() == [4, 2] and not ix.all_slots
    assert ix.cu_seqlens.tolist() == ix.cu_seqlens_cpu.tolist() == [0, 3, FLA_CHUNK + 4, 3 * FLA_CHUNK + 4]
    assert ix.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 1]]
    assert PrefillIndex.build([1, 3], [5, 6], "cpu").all_slots

