"""Speculative decoding: lossless greedy output, both ends of acceptance, the committed state, the MTP head
against an independent reference, and the sampled distribution."""

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.speculative.setup import SpecSetup

from helpers import all_freed, load_hf, random_prompts, vocab_of

LENGTHS = [5, 33, 1, 12, 60]


def _spec_engine(path, method, k, **kw):
    """Every decoding step verifies unless a test says otherwise: these tests are about the verify path (the
    adaptive policy's plain steps: test_spec_policy.py)."""
    kw.setdefault("spec_policy", "fixed")
    ec = EngineConfig(verbose=False, speculative=method, num_speculative_tokens=k, **kw)
    return Engine(path, engine_config=ec, spec_setup=SpecSetup(method))


def _run(engine, prompts, params):
    rids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(r) for r in rids]


@pytest.fixture(scope="module")
def reference_a(ckpt_a):
    """Non-speculative greedy outputs of checkpoint a, the ground truth for lossless checks."""
    prompts = random_prompts(vocab_of(ckpt_a), LENGTHS, seed=30)
    outs = LLM(ckpt_a, verbose=False, chunk_size=16).generate(
        prompts, SamplingParams(max_tokens=14, temperature=0), use_tqdm=False)
    return prompts, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def long_reference_a(ckpt_a, reference_a):
    """The same continuations, long enough that an oracle can propose correct drafts past max_tokens."""
    prompts, _ = reference_a
    outs = LLM(ckpt_a, verbose=False).generate(prompts, SamplingParams(max_tokens=24, temperature=0),
                                               use_tqdm=False)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


@pytest.mark.parametrize("method", ["mtp", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_lossless_greedy(ckpt_a_mtp, reference_a, method, k):
    prompts, ref = reference_a
    eng = _spec_engine(ckpt_a_mtp, method, k, chunk_size=16, max_num_seqs=4)
    outs = _run(eng, prompts, SamplingParams(max_tokens=14, temperature=0))
    assert [o.token_ids for o in outs] == ref
    for o in outs:
        assert o.spec.verify_steps > 0 and o.spec.draft_tokens == k * o.spec.verify_steps
        assert 1.0 <= o.spec.mean_accept_length <= k + 1


def _oracle_hook(ref_by_prompt, vocab, correct: bool, correct_first_only: bool = False):
    def hook(reqs, drafts, first_out):
        out = drafts.clone()
        first_out = first_out.tolist()  # the host's output count may lag (overlap loop): ask the device
        for b, req in enumerate(reqs):
            ref = ref_by_prompt[tuple(req.prompt_ids)]
            for i in range(drafts.shape[1]):
                idx = first_out[b] + i
                tok = ref[idx] if idx < len(ref) else 0
                good = correct and (not correct_first_only or i == 0)
                out[b, i] = tok if good else (tok + 1) % vocab
        return out
    return hook


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_forced_full_acceptance_and_full_rejection(ckpt_a_mtp, reference_a, long_reference_a, method):
    prompts, ref = reference_a
    by_prompt = long_reference_a
    vocab = vocab_of(ckpt_a_mtp)
    k = 3
    for correct in (True, False):
        # every step verifies (the adaptive policy would stop verifying drafts that are never accepted)
        eng = _spec_engine(ckpt_a_mtp, method, k, chunk_size=16)
        eng.worker.draft_hook = _oracle_hook(by_prompt, vocab, correct)
        outs = _run(eng, prompts, SamplingParams(max_tokens=14, temperature=0))
        assert [o.token_ids for o in outs] == ref
        for o in outs:
            s = o.spec
            if correct:
                # every draft accepted: k + 1 tokens per verify, but none past max_tokens (the last verify's are cut
                # there: the request's state then holds exactly its output)
                assert s.verify_steps == -(-(14 - 1) // (k + 1))
                assert s.accepted_tokens == (14 - 1) - s.verify_steps
            else:
                assert s.accepted_tokens == 0 and s.mean_accept_length == 1.0 and s.verify_steps == 13


@pytest.mark.parametrize("commit", ["replay", "checkpoints"])
def test_state_after_partial_rejection_equals_plain_decoding(ckpt_b_mtp, commit):
    """After a verify that accepted one of three drafts, the committed conv and recurrent states equal plain
    decoding's, with either commit: the replay of the kept inputs or the copy of the checkpoint."""
    vocab = vocab_of(ckpt_b_mtp)
    prompt = random_prompts(vocab, [11], seed=31)[0]
    ref = LLM(ckpt_b_mtp, verbose=False).generate(prompt, SamplingParams(max_tokens=12, temperature=0),
                                                   use_tqdm=False)[0].token_ids
    spec = _spec_engine(ckpt_b_mtp, "mtp", 3, overlap=False, spec_commit=commit)  # inspects each step's state
    assert (spec.caches.state_pool.verify_recurrent is None) == (commit == "replay")
    spec.worker.draft_hook = _oracle_hook({tuple(prompt): ref}, vocab, True, correct_first_only=True)
    rid = spec.add_request(prompt, SamplingParams(max_tokens=12, temperature=0))
    req = spec.scheduler.running[0] if spec.scheduler.running else spec.scheduler.waiting[0]
    spec.step()  # prefill
    spec.step()  # verify: draft 1 accepted, drafts 2 and 3 rejected
    # committed: the first output token (fed by the verify) and the accepted draft
    assert req.spec.accepted_tokens == 1 and req.num_computed == len(prompt) + 2
    plain = Engine(ckpt_b_mtp, engine_config=EngineConfig(verbose=False, overlap=False))
    plain.add_request(prompt, SamplingParams(max_tokens=12, temperature=0))
    preq = plain.scheduler.waiting[0]
    while preq.num_computed < req.num_computed:
        plain.step()
    assert preq.num_computed == req.num_computed and preq.output_ids == req.output_ids
    for name in ("conv", "recurrent"):
        a = getattr(spec.caches.state_pool, name)[:, req.state_slot]
        b = getattr(plain.caches.state_pool, name)[:, preq.state_slot]
        assert torch.allclose(a, b, atol=1e-5, rtol=0), name
    spec.abort(rid)


def _hf_mtp_reference(path, prompt, k):
    """Greedy MTP drafts after prefilling ``prompt``, computed from HF modules on the full sequence (no cache)."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_next import modeling_qwen3_next as M

    hf = load_hf(path)
    cfg = hf.config
    tensors = load_file(f"{path}/model.safetensors")
    attn_idx = cfg.layer_types.index("full_attention")
    layer = M.Qwen3NextDecoderLayer(cfg, attn_idx).eval()
    sd = {}
    E = cfg.num_experts
    for name, t in tensors.items():
        if name.startswith("mtp.layers.0.") and ".experts." not in name:
            sd[name[len("mtp.layers.0."):]] = t
    p = "mtp.layers.0.mlp.experts"
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                             tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(E)])
    sd["mlp.experts.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(E)])
    layer.load_state_dict(sd)

    def rms(w, x):
        n = M.Qwen3NextRMSNorm(x.shape[-1], cfg.rms_norm_eps)
        n.weight = torch.nn.Parameter(w)
        return n(x)

    rotary = M.Qwen3NextRotaryEmbedding(cfg)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        h_target = hf.model(ids).last_hidden_state[0]  # [P, H] after the final norm
        first = int(hf(ids).logits[0, -1].argmax())
        tokens = list(prompt[1:]) + [first]
        hiddens = [h_target[i] for i in range(len(prompt))]
        drafts = []
        for _ in range(k):
            L = len(tokens)
            emb = hf.model.embed_tokens(torch.tensor([tokens]))
            x = torch.cat([rms(tensors["mtp.pre_fc_norm_embedding.weight"], emb),
                           rms(tensors["mtp.pre_fc_norm_hidden.weight"], torch.stack(hiddens)[None])], -1)
            x = x @ tensors["mtp.fc.weight"].T
            pos = torch.arange(L)[None]
            mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
            x = layer(x, position_embeddings=rotary(x, pos), attention_mask=mask, position_ids=pos)
            x = x[0] if isinstance(x, tuple) else x
            m = rms(tensors["mtp.norm.weight"], x)[0, -1]
            d = int(hf.lm_head(m).argmax())
            drafts.append(d)
            tokens.append(d)
            hiddens.append(m)
    return drafts


def test_mtp_drafts_match_an_independent_reference(ckpt_a_mtp):
    prompt = random_prompts(vocab_of(ckpt_a_mtp), [9], seed=32)[0]
    k = 3
    expected = _hf_mtp_reference(ckpt_a_mtp, prompt, k)
    # prefill in 3 chunks: MTP KV built chunk by chunk; no overlap, so the drafts are read right after the prefill
    eng = _spec_engine(ckpt_a_mtp, "mtp", k, chunk_size=4, overlap=False)
    eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=0))
    req = eng.scheduler.waiting[0]
    while req.num_computed < len(prompt):
        eng.step()
    assert eng.worker.drafter.drafts[req.req_slot].tolist() == expected


def test_bad_speculative_options(ckpt_a):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(ckpt_a, speculative="mtp", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative must be"):
        LLM(ckpt_a, speculative="eagle")
    with pytest.raises(ValueError, match="mtp"):
        LLM(ckpt_a, speculative="mtp", verbose=False)  # transformers wrote no mtp.* tensors
    with pytest.raises(ValueError, match="simulate_accept_length"):
        LLM(ckpt_a, speculative="ngram", num_speculative_tokens=2, simulate_accept_length=4.0)


def test_simulated_accept_length_is_reached(ckpt_a):
    eng = _spec_engine(ckpt_a, "ngram", 3, simulate_accept_length=3.0)
    outs = _run(eng, random_prompts(vocab_of(ckpt_a), [6, 9, 4, 7], seed=33),
                SamplingParams(max_tokens=61, temperature=0))
    steps = sum(o.spec.verify_steps for o in outs)
    emitted = sum(o.spec.emitted_tokens for o in outs)
    assert abs(emitted / steps - 3.0) < 0.05


@pytest.mark.parametrize("method,k", [("mtp", 3), ("ngram", 5)])
def test_speculation_up_to_the_context_limit(ckpt_a_mtp, method, k):
    """Verify passes and drafts reserve positions past the last token; at the context limit that must neither
    overflow the tables nor change the output."""
    prompts = random_prompts(vocab_of(ckpt_a_mtp), [20, 7], seed=34)
    params = SamplingParams(max_tokens=100, temperature=0)
    plain = _run(Engine(ckpt_a_mtp, engine_config=EngineConfig(verbose=False, max_model_len=30)), prompts, params)
    eng = _spec_engine(ckpt_a_mtp, method, k, max_model_len=30, kv_cache_tokens=2 * (30 + 2 * k))
    outs = _run(eng, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" and len(o.prompt_token_ids) + len(o.token_ids) == 30 for o in outs)


def test_a_context_limit_the_pool_cannot_hold_with_the_drafts_is_refused(ckpt_a_mtp):
    """An explicit max_model_len is kept or refused, never lowered in silence: a request at the limit also reserves
    2k positions for its verify and drafts. A limit from the pool's size leaves room for them."""
    with pytest.raises(ValueError, match=r"max_model_len=64 does not fit the KV pool of 66 tokens with the 8 "
                                         r"positions 4 speculative tokens reserve past it"):
        _spec_engine(ckpt_a_mtp, "ngram", 4, kv_cache_tokens=66, max_model_len=64)
    assert _spec_engine(ckpt_a_mtp, "ngram", 4, kv_cache_tokens=66, max_model_len=58).max_model_len == 58
    assert _spec_engine(ckpt_a_mtp, "ngram", 4, kv_cache_tokens=66).max_model_len == 58
    # a pool sized by default holds a slot at the limit with its drafts' positions (it was max_num_seqs x the
    # limit, which then refused the limit it was sized from)
    eng = _spec_engine(ckpt_a_mtp, "ngram", 3, max_num_seqs=1, max_model_len=100)
    assert eng.max_model_len == 100 and eng.caches.kv_pool.num_tokens >= 106


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculation_with_preemption_and_abort(ckpt_a_mtp, method):
    """KV exhaustion preempts and re-runs requests mid-speculation; an abort frees a verifying request's slots; the
    other outputs stay exactly the plain greedy ones and every slot comes back."""
    prompts = random_prompts(vocab_of(ckpt_a_mtp), [20, 25, 18, 22, 9], seed=35)
    params = SamplingParams(max_tokens=20, temperature=0)
    plain = _run(Engine(ckpt_a_mtp, engine_config=EngineConfig(verbose=False)), prompts, params)
    eng = _spec_engine(ckpt_a_mtp, method, 3, kv_cache_tokens=90, max_model_len=50, chunk_size=32)
    rids = [eng.add_request(p, params) for p in prompts]
    for _ in range(4):
        eng.step()
    assert eng.abort(rids[4])
    while eng.has_unfinished():
        eng.step()
    outs = [eng.pop_finished(r) for r in rids]
    assert [o.token_ids for o in outs[:4]] == [o.token_ids for o in plain[:4]]
    assert outs[4].finish_reason == "abort"
    assert sum(o.num_preemptions for o in outs) > 0
    assert all_freed(eng)
