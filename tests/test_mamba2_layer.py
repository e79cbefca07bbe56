"""The Mamba2 mixer layer and backend against transformers' NemotronH mixer on the same weights: a prefill split
into chunks that continue the slot's state, decode steps by slot beside a padded row, and a verify that writes no
slot, whose commit lands each row on its accepted step."""

import pytest
import torch

from hylo.backends.mamba2 import Mamba2Backend
from hylo.cache.state_pool import StatePool
from hylo.core import ForwardBatch, ForwardMode
from hylo.config import Mamba2Spec
from hylo.layers.mamba2 import Mamba2Mixer
from hylo.layers.weights import DictReader

hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
from transformers import NemotronHConfig  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, KERNEL = 24, 6, 5, 3, 7, 4


@pytest.fixture(scope="module")
def pair():
    cfg = NemotronHConfig(hidden_size=HIDDEN, mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, ssm_state_size=STATE,
                          n_groups=GROUPS, conv_kernel=KERNEL, use_conv_bias=True, use_bias=True,
                          layer_norm_epsilon=1e-5, chunk_size=8, layer_types=["linear_attention"],
                          num_attention_heads=2, num_key_value_heads=2, vocab_size=50)
    torch.manual_seed(0)
    mixer = hf.NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.dt_bias.add_(1.0)  # softplus well above the prefill's dt limit: prefill and decode agree
    shape = Mamba2Spec(HEADS, HEAD_DIM, GROUPS, STATE, KERNEL, True, True, 1e-5, (cfg.time_step_min, float("inf")),
                       chunk_size=4)
    ours = Mamba2Mixer(HIDDEN, shape, 0, torch.float32)
    ours.load(DictReader({f"m.{k}": v.detach() for k, v in mixer.state_dict().items()}), "m")
    return mixer, ours, shape


def _backend(shape, slots=4, verify_steps=0):
    pool = StatePool(1, slots, shape.conv_dim, KERNEL, HEADS, HEAD_DIM, STATE, torch.float32, torch.float32,
                     torch.device("cpu"))
    if verify_steps:
        pool.alloc_verify_buffers(slots, verify_steps)
    return pool, _Route(Mamba2Backend(pool))


class _Route:
    """The hybrid backend's routing for a model of one Mamba2 layer (layer 0 is linear layer 0)."""

    def __init__(self, backend):
        self.backend = backend

    def linear_attention(self, layer_id, *args):
        return self.backend.forward(layer_id, *args)

    def commit_verified(self, slots, accepted):
        self.backend.commit_verified(slots, accepted)


def _batch(mode, state_slots, lens=None, steps=1):
    n = sum(lens) if lens else len(state_slots) * steps
    z = torch.zeros(n, dtype=torch.int64)
    b = torch.zeros(len(state_slots), dtype=torch.int64)
    return ForwardBatch(mode=mode, input_ids=z, positions=z, req_slots=b, state_slots=torch.tensor(state_slots),
                        seq_lens=b, query_start_loc=torch.zeros(len(state_slots) + 1, dtype=torch.int64),
                        out_cache_loc=z, max_seq_len=1, extend_lens_cpu=lens,
                        state_slots_cpu=list(state_slots) if lens else None, tokens_per_row=steps)


def test_prefill_chunks_and_decode_match_transformers(pair):
    mixer, ours, shape = pair
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n, HIDDEN, generator=g) for n in (11, 6)]
    with torch.no_grad():
        want = [mixer(s[None])[0] for s in seqs]
    pool, backend = _backend(shape)
    # prefill in two chunks per sequence (5 + 4 and 3 + 2 tokens, the scan's own chunks are 4), two rows a step
    first = [5, 3]
    out1 = ours(torch.cat([s[:n] for s, n in zip(seqs, first)]), _batch(ForwardMode.EXTEND, [2, 3], first), backend)
    second = [4, 2]
    out2 = ours(torch.cat([s[n:n + m] for s, n, m in zip(seqs, first, second)]),
                _batch(ForwardMode.EXTEND, [2, 3], second), backend)
    assert torch.allclose(out1[:5], want[0][:5], atol=1e-5) and torch.allclose(out1[5:], want[1][:3], atol=1e-5)
    assert torch.allclose(out2[:4], want[0][5:9], atol=1e-5) and torch.allclose(out2[4:], want[1][3:5], atol=1e-5)
    # the remaining tokens one step at a time by slot, with a padded row (-1) that touches nothing
    before = pool.recurrent[0, 1].clone()
    for i in range(2):
        rows = [seqs[0][9 + i]] + ([seqs[1][5]] if i == 0 else [torch.zeros(HIDDEN)])
        slots = [2, 3] if i == 0 else [2, -1]
        out = ours(torch.stack(rows + [torch.zeros(HIDDEN)]), _batch(ForwardMode.DECODE, slots + [-1]), backend)
        assert torch.allclose(out[0], want[0][9 + i], atol=1e-5)
        if i == 0:
            assert torch.allclose(out[1], want[1][5], atol=1e-5)
    assert torch.equal(pool.recurrent[0, 1], before)  # never a real slot here: untouched


def test_verify_writes_no_slot_and_commit_lands_on_the_accepted_step(pair):
    mixer, ours, shape = pair
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randn(10, HIDDEN, generator=g) for _ in range(2)]
    with torch.no_grad():
        want = [mixer(s[None])[0] for s in seqs]
    steps = 4
    pool, backend = _backend(shape, verify_steps=steps)
    ours(torch.cat([s[:6] for s in seqs]), _batch(ForwardMode.EXTEND, [1, 2], [6, 6]), backend)
    slots_before = (pool.conv.clone(), pool.recurrent.clone())
    out = ours(torch.cat([s[6:10] for s in seqs]), _batch(ForwardMode.TARGET_VERIFY, [1, 2], steps=steps), backend)
    assert torch.allclose(out[:steps], want[0][6:10], atol=1e-5)
    assert torch.allclose(out[steps:], want[1][6:10], atol=1e-5)
    assert torch.equal(pool.conv, slots_before[0]) and torch.equal(pool.recurrent, slots_before[1])
    # row 0 accepts one draft (its state after token 7), row 1 none (after token 6); then decoding goes on exactly
    backend.commit_verified(torch.tensor([1, 2]), torch.tensor([1, 0]))
    out = ours(torch.stack([seqs[0][8], seqs[1][7]]), _batch(ForwardMode.DECODE, [1, 2]), backend)
    assert torch.allclose(out[0], want[0][8], atol=1e-5) and torch.allclose(out[1], want[1][7], atol=1e-5)
