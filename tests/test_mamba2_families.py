"""The Mamba2 families against transformers 5.24's own models, on checkpoints it wrote with ``save_pretrained`` (the
released names): Nemotron-H (Mamba2, attention without positional encoding, squared-ReLU MLP blocks; ``backbone.*``),
Granite-4.0-H (Mamba2 or RoPE attention, then a MoE plus a shared MLP, muP multipliers) and Falcon-H1 (Mamba2 and
attention side by side in every layer, muP multipliers folded into the projections). Prompt logits, greedy
batches of mixed lengths through chunked prefill whose chunks split the scan's, n-gram speculation and prefix
caching exact, and what is not served yet refused before a weight is read."""

import json
import os

import pytest

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine

from helpers import (all_freed, assert_logits_match, hf_greedy, make_nemotron_h_checkpoint, random_prompts, run_all,
                     spec_engine)


@pytest.fixture(params=["nemotron_h", "granite_hybrid", "falcon_h1"])
def family(request):  # (path, the transformers model): conftest's session checkpoints
    return request.getfixturevalue(request.param)


@pytest.fixture
def nemotron(nemotron_h):
    return nemotron_h


def test_prefill_logits_match_transformers(family):
    path, hf = family
    eng = Engine(path, device="cpu", dtype="float32",
                 engine_config=EngineConfig(chunk_size=6, max_num_seqs=4, verbose=False))
    assert_logits_match(eng, hf, random_prompts(hf.config.vocab_size, [1, 11, 53], seed=11))


def test_greedy_batch_of_mixed_lengths_matches_transformers(family):
    path, hf = family
    prompts = random_prompts(hf.config.vocab_size, [4, 37, 1, 19, 66], seed=12)
    llm = LLM(path, device="cpu", dtype="float32", chunk_size=13, max_num_seqs=8, verbose=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)


def test_ngram_speculation_and_prefix_caching_are_exact(family):
    path, hf = family
    vocab = hf.config.vocab_size
    # repetitive prompts, so that n-gram drafts get accepted
    prompts = [(p * 4)[:n] for p, n in zip(random_prompts(vocab, [5, 7, 3], seed=13), [20, 31, 12])]
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = run_all(spec_engine(path, enable_prefix_caching=False), prompts, params)
    eng = spec_engine(path, "ngram")
    outs = run_all(eng, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # drafts that are right (the plain outputs) but for every third: accepted and rejected drafts in one verify
    oracle = spec_engine(path, "ngram")
    ref = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}

    def hook(reqs, drafts, first_out):
        out = drafts.clone()
        for b, (req, start) in enumerate(zip(reqs, first_out.tolist())):
            want = ref[tuple(req.prompt_ids)]
            for i in range(drafts.shape[1]):
                idx = start + i
                tok = want[idx] if idx < len(want) else 0
                out[b, i] = tok if idx % 3 else (tok + 1) % vocab
        return out

    oracle.worker.draft_hook = hook
    forced = run_all(oracle, prompts, params)
    assert [o.token_ids for o in forced] == [o.token_ids for o in plain]
    assert sum(o.spec.accepted_tokens for o in forced) >= 6
    # next turns resume from the cached state snapshots (and n-gram keeps verifying them)
    turn2 = [p + o.token_ids + q for p, o, q in zip(prompts, plain, random_prompts(vocab, [3, 9, 4], seed=14))]
    cold = run_all(spec_engine(path, enable_prefix_caching=False), turn2, params)
    hot = run_all(eng, turn2, params)
    assert [o.token_ids for o in hot] == [o.token_ids for o in cold]
    assert all(o.num_cached_tokens >= len(p) for o, p in zip(hot, prompts))
    assert all_freed(eng)


def test_unsupported_forms_are_refused_before_any_weight(tmp_path, nemotron):
    path, _ = nemotron
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for change, words in (({"layers_block_type": ["linear_attention", "moe"], "n_routed_experts": 6, "n_group": 4},
                           "router's groups"),
                          ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
                          ({"mamba_num_heads": 5}, "n_groups"),
                          ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                    "activation_scheme": "dynamic"}}, "quantized")):
        bad = tmp_path / words.replace(" ", "_")
        bad.mkdir()
        with open(bad / "config.json", "w") as f:
            json.dump({**cfg, **change}, f)
        # no weights at all in the folder: the refusal comes from the config alone
        with pytest.raises(ValueError, match=words):
            Engine(str(bad), device="cpu", engine_config=EngineConfig(verbose=False))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0.*ngram"):
        spec_engine(path, "mtp")


def test_tensor_parallelism_is_refused_by_name(family):
    path, _ = family
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM(path, device="cpu", tensor_parallel_size=2, verbose=False)


def test_granite_layer_names_as_released_read_as_transformers_writes_them(granite_hybrid):
    """Released Granite-4.0-H configs name the layers "mamba" / "attention" (transformers maps them to the current
    names on load and writes those); both spellings give the same model config."""
    from hylo.models.granite_hybrid import parse_config

    path, _ = granite_hybrid
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    released = {**cfg, "layer_types": [{"linear_attention": "mamba", "full_attention": "attention"}[t]
                                       for t in cfg["layer_types"]]}
    assert parse_config(released) == parse_config(cfg)
    assert parse_config(released).layer_types.count("full_attention") == 2
    # transformers' reading of the sizes: mamba_d_head "auto" is derived (its default), no layer_types means every
    # layer Mamba2, and a layer count the list contradicts is refused (transformers refuses it too)
    auto = {**cfg, "mamba_d_head": "auto"}
    assert parse_config(auto).mamba.head_dim == parse_config(cfg).mamba.head_dim
    untyped = {k: v for k, v in cfg.items() if k != "layer_types"}
    assert parse_config(untyped).layer_types == ("linear_attention",) * cfg["num_hidden_layers"]
    for n in (len(cfg["layer_types"]) - 1, len(cfg["layer_types"]) + 2):
        with pytest.raises(ValueError, match=f"num_hidden_layers is {n}, but layer_types lists"):
            parse_config({**cfg, "num_hidden_layers": n})


def test_granite_without_positional_encoding_or_experts_matches_transformers(tmp_path):
    """Granite-4.0-H as released uses no positional encoding ("nope"); its dense variants have no experts (the
    shared MLP alone)."""
    from helpers import make_granite_hybrid_checkpoint

    path, hf = make_granite_hybrid_checkpoint(str(tmp_path / "g"), position_embedding_type="nope",
                                              num_local_experts=0)
    eng = Engine(path, device="cpu", dtype="float32", engine_config=EngineConfig(chunk_size=7, verbose=False))
    assert eng.model.layers[1].mixer.rotary is None and eng.model.layers[0].moe is None
    prompt = random_prompts(hf.config.vocab_size, [29], seed=15)[0]
    assert_logits_match(eng, hf, [prompt])
    out = LLM(path, device="cpu", dtype="float32", chunk_size=7, verbose=False).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(hf, prompt, 8)


def test_granite_refusals(tmp_path, granite_hybrid):
    path, _ = granite_hybrid
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    rope = {"position_embedding_type": "rope"}
    for change, words in (({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
                          # the older spellings and a partial rotation are refused too (they were served as
                          # plain RoPE over whole heads)
                          ({**rope, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
                          ({**rope, "rope_parameters": {"type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
                          ({**rope, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
                          ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"mamba_d_head": 7}, "mamba_expand")):
        bad = tmp_path / words.replace(" ", "_").replace("'", "")
        bad.mkdir()
        with open(bad / "config.json", "w") as f:
            json.dump({**cfg, **change}, f)
        with pytest.raises(ValueError, match=words):
            Engine(str(bad), device="cpu", engine_config=EngineConfig(verbose=False))


def test_falcon_rope_beyond_plain_is_refused():
    from hylo.models.falcon_h1 import parse_config as falcon_config

    for change, words in (({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
                          ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
                          ({"partial_rotary_factor": 0.5}, "partial_rotary_factor")):
        with pytest.raises(ValueError, match=words):
            falcon_config({"model_type": "falcon_h1", **change})
    assert falcon_config({"model_type": "falcon_h1", "rope_theta": 5e5}).rope_theta == 5e5


def test_falcon_with_its_gated_norm_matches_transformers(tmp_path):
    """Falcon-H1 with ``mamba_rms_norm`` (the norm before the gate, and after it)."""
    from helpers import make_falcon_h1_checkpoint

    for before in (True, False):
        path, hf = make_falcon_h1_checkpoint(str(tmp_path / f"f{before}"), mamba_rms_norm=True,
                                             mamba_norm_before_gate=before)
        prompt = random_prompts(hf.config.vocab_size, [23], seed=16)[0]
        eng = Engine(path, device="cpu", dtype="float32", engine_config=EngineConfig(chunk_size=5, verbose=False))
        assert_logits_match(eng, hf, [prompt])
        out = LLM(path, device="cpu", dtype="float32", chunk_size=5, verbose=False).generate(
            [prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
        assert out.token_ids == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize("latent,shared,folded", [(16, 20, 0), (None, 20, 0), (None, 36, 3), (None, 36, "off")])
def test_nemotron3_moe_blocks_match_transformers_on_the_cpu(tmp_path, monkeypatch, latent, shared, folded):
    """Nemotron 3's MoE blocks (grouped sigmoid routing with a correction bias, non-gated squared-ReLU experts on a
    latent projection or not, a shared expert: apart, or folded in as three more experts where its width is three
    times theirs): prompt logits, greedy batches through chunked prefill and n-gram speculation as transformers
    5.24 computes them."""
    from helpers import make_nemotron3_checkpoint
    from hylo.layers import mlp

    if folded == "off":  # HYLO_NEMOTRON_FOLD_SHARED=0: the shared expert kept apart where it could fold
        monkeypatch.setattr(mlp, "FOLD_SHARED", False)
        folded = 0
    path, hf = make_nemotron3_checkpoint(str(tmp_path / "n3"), moe_latent_size=latent,
                                         moe_shared_expert_intermediate_size=shared)
    eng = Engine(path, device="cpu", dtype="float32", engine_config=EngineConfig(chunk_size=7, verbose=False))
    moe = eng.model.layers[1].mixer
    assert type(moe).__name__ == "GroupedSigmoidMoE" and moe.folded == folded
    assert (moe.shared is None) == bool(folded) and moe.up.shape[0] == 8 + folded
    vocab = hf.config.vocab_size
    assert_logits_match(eng, hf, random_prompts(vocab, [1, 23], seed=16))
    prompts = random_prompts(vocab, [5, 30, 12], seed=17)
    params = SamplingParams(max_tokens=9, temperature=0)
    outs = run_all(spec_engine(path, chunk_size=11, enable_prefix_caching=False), prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 9) for p in prompts]
    spec = run_all(spec_engine(path, "ngram", chunk_size=11), prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in outs]


def test_prompt_tokens_are_clamped_and_generated_ones_not_whatever_shares_their_steps(tmp_path):
    """A Nemotron-H whose prefill clamp of dt bites (time_step_min 0.3; the released 0.001 seldom does): transformers
    clamps a prompt's tokens and never the ones it generates. A one-token prompt, prompts whose last chunk is one
    token, and decoding rows that share steps with other requests' prefills all give transformers' greedy tokens;
    a next turn through the prefix cache gives the log probabilities it gives without (the reply's state, which
    decoding computed unclamped, is not reused: the prompt's snapshot is)."""
    path, hf = make_nemotron_h_checkpoint(str(tmp_path / "nem"), time_step_min=0.3)
    prompts = random_prompts(hf.config.vocab_size, [1, 17, 33, 6], seed=21)
    want = [hf_greedy(hf, p, 8) for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0)
    for overlap in (True, False):
        eng = Engine(path, device="cpu", dtype="float32",
                     engine_config=EngineConfig(chunk_size=16, max_num_seqs=4, overlap=overlap, prefix_snapshots=32,
                                                verbose=False))
        rids = []
        for p in prompts:  # each arrives while the earlier ones decode: they ride along in its prefill steps
            rids.append(eng.add_request(p, params))
            eng.step()
            eng.step()
        while eng.has_unfinished():
            eng.step()
        outs = [eng.pop_finished(r) for r in rids]
        assert [o.token_ids for o in outs] == want
    turn2 = [p + o.token_ids + q for p, o, q in zip(prompts, outs, random_prompts(hf.config.vocab_size, [1, 3, 1, 5],
                                                                                   seed=22))]
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=0)
    hot = run_all(eng, turn2, params)
    cold = run_all(Engine(path, device="cpu", dtype="float32",
                          engine_config=EngineConfig(chunk_size=16, enable_prefix_caching=False, verbose=False)),
                   turn2, params)
    assert [o.token_ids for o in hot] == [o.token_ids for o in cold]
    for h, c in zip(hot, cold):
        assert [x.logprob for x in h.logprobs] == pytest.approx([x.logprob for x in c.logprobs], abs=1e-5)
    assert all(o.num_cached_tokens >= len(p) for o, p in zip(hot, prompts))
    assert all_freed(eng)


@pytest.mark.parametrize("cache", [False, True])
def test_a_preempted_request_recomputes_its_outputs_unclamped(tmp_path, cache):
    """A preempted request computes its generated tokens again as a prefill chunk: that chunk starts at the prompt's
    end and runs unclamped, as decoding computed them, so a preempted request's log probabilities are an
    uninterrupted one's (they moved by up to 0.96 with the clamp on the recomputed outputs)."""
    path, hf = make_nemotron_h_checkpoint(str(tmp_path / "nem"), time_step_min=0.3)
    prompts = random_prompts(hf.config.vocab_size, [20, 25, 18, 22], seed=100)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True, logprobs=0) for i in range(4)]
    roomy = LLM(path, verbose=False, chunk_size=32, enable_prefix_caching=False)
    tight = LLM(path, verbose=False, chunk_size=32, enable_prefix_caching=cache, kv_cache_tokens=70,
                max_model_len=50)
    want, got = roomy.generate(prompts, params, use_tqdm=False), tight.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_preemptions for o in got) > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-4)
    assert all_freed(tight.engine)


def test_nemotron_reads_its_own_lm_head_whatever_tie_word_embeddings_says(tmp_path):
    """transformers' NemotronH ignores tie_word_embeddings (its lm_head is always its own tensor, written and read)
    and attention_bias (no biases): so does hylo."""
    path, hf = make_nemotron_h_checkpoint(str(tmp_path / "nem"), tie_word_embeddings=True, attention_bias=True)
    eng = Engine(path, device="cpu", dtype="float32", engine_config=EngineConfig(chunk_size=8, verbose=False))
    assert_logits_match(eng, hf, random_prompts(hf.config.vocab_size, [9], seed=23))


def test_granite_without_attention_layers_needs_no_even_rotary_size(tmp_path):
    """All Mamba2 layers, attention heads of an odd size (no attention layer uses them, so no rotary): served, and
    the prompt logits are transformers' (its uncached forward: its cache fails on a model without attention)."""
    import torch

    from helpers import make_granite_hybrid_checkpoint

    path, hf = make_granite_hybrid_checkpoint(str(tmp_path / "g"), layer_types=["linear_attention"] * 3,
                                              num_hidden_layers=3, hidden_size=28, num_attention_heads=4,
                                              num_key_value_heads=2, mamba_n_heads=7, mamba_n_groups=1)
    eng = Engine(path, device="cpu", dtype="float32", engine_config=EngineConfig(chunk_size=8, verbose=False))
    prompt = random_prompts(hf.config.vocab_size, [19], seed=24)[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt]), use_cache=False).logits[0]
    assert torch.allclose(eng.prompt_logits(prompt), want, atol=1e-4)


def test_falcon_mamba_head_size_auto_is_derived(falcon_h1):
    """``mamba_d_head: "auto"`` (transformers' default for Falcon-H1) is the Mamba2 inner size over the heads."""
    from hylo.models.registry import parse_config

    with open(os.path.join(falcon_h1[0], "config.json")) as f:
        cfg = json.load(f)
    assert parse_config({**cfg, "mamba_d_head": "auto"}).mamba.head_dim == falcon_h1[1].config.mamba_d_head
    with pytest.raises(ValueError, match="mamba_d_head must be an integer"):
        parse_config({**cfg, "mamba_d_head": "big"})
