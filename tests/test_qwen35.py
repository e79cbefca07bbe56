"""Qwen3.5 and Qwen3.5-MoE against HF transformers' own classes, on checkpoints transformers wrote: both the released
vision-language form (text under model.language_model.*, a vision tower that is never read) and the text-only form;
MTP and n-gram speculation lossless; the MTP head against an independent reference; clear refusals."""

import json
import os
import shutil

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.models.loader import SafetensorsReader
from hylo.models.registry import parse_config, read_config, supported_model_types

from hylo.speculative.setup import SpecSetup

from helpers import (Q35, assert_logits_match, fuse_experts, hf_greedy, load_hf_qwen35, make_qwen35_checkpoint,
                     random_prompts, vocab_of)


def test_prefill_logits_match_hf(q35):
    path, kind, form = q35
    hf = load_hf_qwen35(path, kind, form)
    eng = Engine(path, device="cpu", dtype="float32",
                 engine_config=EngineConfig(chunk_size=6, max_num_seqs=4, verbose=False))
    assert_logits_match(eng, hf, random_prompts(vocab_of(path), [1, 11, 53], seed=11))


def test_greedy_batch_of_mixed_lengths_matches_hf(q35):
    path, kind, form = q35
    hf = load_hf_qwen35(path, kind, form)
    prompts = random_prompts(vocab_of(path), [4, 37, 1, 19, 66], seed=12)
    llm = LLM(path, device="cpu", dtype="float32", chunk_size=13, max_num_seqs=8, verbose=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)


@pytest.mark.parametrize("method,k", [("mtp", 2), ("mtp", 4), ("ngram", 3)])
def test_speculation_is_lossless(q35_dense_vl, q35_moe_text, method, k):
    for path in (q35_dense_vl, q35_moe_text):
        prompts = random_prompts(vocab_of(path), [5, 30, 12], seed=13)
        params = SamplingParams(max_tokens=12, temperature=0)
        plain = LLM(path, verbose=False, chunk_size=16).generate(prompts, params, use_tqdm=False)
        spec = LLM(path, verbose=False, chunk_size=16, speculative=method, num_speculative_tokens=k,
                   spec_policy="fixed")  # every step verifies
        outs = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert all(o.spec.verify_steps > 0 for o in outs)


def _hf_mtp_drafts(path, kind, form, prompt, k):
    """Greedy MTP drafts after ``prompt``, from transformers' Qwen3.5 decoder layer and norms on the full sequence
    (no cache), with the mtp.* tensors loaded by name."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    hf = load_hf_qwen35(path, kind, form)
    text_model = hf.model.language_model if form == "vl" else hf.model
    cfg = text_model.config
    tensors = load_file(f"{path}/model.safetensors")
    layer_cls = M.Qwen3_5DecoderLayer
    if kind == "moe":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as MM

        layer_cls = MM.Qwen3_5MoeDecoderLayer
    layer = layer_cls(cfg, cfg.layer_types.index("full_attention")).eval()
    layer.load_state_dict({n[len("mtp.layers.0."):]: t for n, t in tensors.items() if n.startswith("mtp.layers.0.")})

    def rms(name, x):
        norm = M.Qwen3_5RMSNorm(x.shape[-1], cfg.rms_norm_eps)
        norm.weight = torch.nn.Parameter(tensors[name])
        return norm(x)

    rotary = M.Qwen3_5TextRotaryEmbedding(cfg)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = list(text_model(ids).last_hidden_state[0])
        tokens = list(prompt[1:]) + [int(hf(ids).logits[0, -1].argmax())]
        drafts = []
        for _ in range(k):
            n = len(tokens)
            x = torch.cat([rms("mtp.pre_fc_norm_embedding.weight", text_model.embed_tokens(torch.tensor([tokens]))),
                           rms("mtp.pre_fc_norm_hidden.weight", torch.stack(hidden)[None])], -1)
            x = x @ tensors["mtp.fc.weight"].T
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            x = layer(x, position_embeddings=rotary(x, pos), attention_mask=mask, position_ids=pos)
            x = x[0] if isinstance(x, tuple) else x
            h = rms("mtp.norm.weight", x)[0, -1]
            drafts.append(int(hf.lm_head(h).argmax()))
            tokens.append(drafts[-1])
            hidden.append(h)
    return drafts


@pytest.mark.parametrize("name", ["dense-vl", "moe-text"])
def test_mtp_drafts_match_an_independent_reference(name, request):
    fixture, kind, form = Q35[name]
    path = request.getfixturevalue(fixture)
    prompt = random_prompts(vocab_of(path), [10], seed=14)[0]
    expected = _hf_mtp_drafts(path, kind, form, prompt, 3)
    eng = Engine(path, engine_config=EngineConfig(verbose=False, overlap=False, chunk_size=4,
                                                  speculative="mtp", num_speculative_tokens=3),
                 spec_setup=SpecSetup("mtp"))
    eng.add_request(prompt, SamplingParams(max_tokens=5, temperature=0))
    req = eng.scheduler.waiting[0]
    while req.num_computed < len(prompt):
        eng.step()
    assert eng.worker.drafter.drafts[req.req_slot].tolist() == expected


def test_vision_tower_is_never_read(q35_moe_vl, capsys):
    loaded = []
    original = SafetensorsReader._load

    def spy(self, name):
        loaded.append(name)
        return original(self, name)

    SafetensorsReader._load = spy
    try:
        eng = Engine(q35_moe_vl, device="cpu", engine_config=EngineConfig(speculative="mtp"),
                     spec_setup=SpecSetup("mtp"))
    finally:
        SafetensorsReader._load = original
    assert loaded and not [n for n in loaded if n.startswith("model.visual.")]
    assert any(n.startswith("mtp.") for n in loaded)
    visual = [k for k in eng.reader.keys() if k.startswith("model.visual.")]
    err = capsys.readouterr().err
    assert visual and f"the vision tower ({len(visual)} tensors under model.visual.*) is not loaded" in err
    assert "not used" not in err  # nothing else was left over


def test_fused_experts_load_the_same(tmp_path, q35_moe_text):
    """A checkpoint whose routed experts are stored fused (experts.gate_up_proj / experts.down_proj) gives the same
    logits as the per-expert one transformers wrote."""
    from safetensors.torch import load_file, save_file

    fused = str(tmp_path / "fused")
    shutil.copytree(q35_moe_text, fused)
    file = os.path.join(fused, "model.safetensors")
    tensors = fuse_experts(load_file(file))
    assert any(k.endswith("experts.gate_up_proj") for k in tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    prompt = random_prompts(vocab_of(fused), [25], seed=15)[0]
    a = Engine(q35_moe_text, engine_config=EngineConfig(verbose=False)).prompt_logits(prompt)
    b = Engine(fused, engine_config=EngineConfig(verbose=False)).prompt_logits(prompt)
    assert torch.equal(a, b)


def test_config_forms_and_refusals(q35_dense_vl):
    with open(os.path.join(q35_dense_vl, "config.json")) as f:
        cfg = json.load(f)
    mc = read_config(q35_dense_vl)
    assert mc.model_type == "qwen3_5" and mc.tie_word_embeddings and mc.num_experts == 0
    assert mc.rotary_dim == 12 and mc.rope_theta == 20000.0
    # transformers ties by the outer flag alone: missing there, the head is untied whatever text_config says
    outer = {k: v for k, v in cfg.items() if k != "tie_word_embeddings"}
    assert not parse_config({**outer, "text_config": {**cfg["text_config"], "tie_word_embeddings": True}}
                            ).tie_word_embeddings
    assert parse_config({**cfg, "tie_word_embeddings": True, "text_config": {**cfg["text_config"],
                                                                            "tie_word_embeddings": False}}
                        ).tie_word_embeddings
    # the text form of the same model parses to the same shape, and the caller's dict stays as it was
    given = {**cfg["text_config"], "model_type": "qwen3_5_text"}
    before = json.dumps(given, sort_keys=True)
    text = parse_config(given)
    assert json.dumps(given, sort_keys=True) == before
    assert (text.hidden_size, text.layer_types, text.intermediate_size) == (mc.hidden_size, mc.layer_types,
                                                                           mc.intermediate_size)
    with pytest.raises(ValueError, match="mrope_section"):
        parse_config({**cfg, "text_config": {**cfg["text_config"],
                                             "rope_parameters": {**cfg["text_config"]["rope_parameters"],
                                                                 "mrope_section": [3, 2, 2]}}})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        parse_config({**cfg, "text_config": {**cfg["text_config"], "rope_parameters": {"rope_type": "yarn"}}})
    with pytest.raises(ValueError, match="text_config"):
        parse_config({"model_type": "qwen3_5"})
    with pytest.raises(ValueError) as e:
        parse_config({"model_type": "mamba"})
    for t in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"):
        assert repr(t) in str(e.value) and t in supported_model_types()


def test_stop_ids_from_both_config_levels_and_generation_config(tmp_path, q35_dense_vl):
    d = str(tmp_path / "m")
    shutil.copytree(q35_dense_vl, d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = 7
    cfg["text_config"]["eos_token_id"] = 8
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [9, 7]}, f)
    assert read_config(d).eos_token_ids == (7, 8, 9)


def test_missing_tensor_is_refused_by_name(tmp_path, q35_dense_vl):
    from safetensors.torch import load_file, save_file

    from hylo.layers.weights import CheckpointError

    d = str(tmp_path / "m")
    shutil.copytree(q35_dense_vl, d)
    file = os.path.join(d, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.language_model.layers.2.linear_attn.in_proj_z.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="in_proj_z"):
        Engine(d, engine_config=EngineConfig(verbose=False))


def test_tensor_parallel_matches_one_rank(tmp_path):
    """Two ranks (gloo) on a released-form MoE checkpoint whose experts are stored fused: each rank reads its slice
    of in_proj_qkv / z / b / a and of the fused experts, and the tokens are one rank's."""
    from safetensors.torch import load_file, save_file

    path = make_qwen35_checkpoint(str(tmp_path / "tp"), "moe", "vl", num_attention_heads=4, linear_num_key_heads=2,
                                  linear_num_value_heads=4)
    file = os.path.join(path, "model.safetensors")
    save_file(fuse_experts(load_file(file)), file, metadata={"format": "pt"})
    prompts = random_prompts(vocab_of(path), [9, 21], seed=16)
    params = SamplingParams(max_tokens=6, temperature=0)
    one = LLM(path, verbose=False).generate(prompts, params, use_tqdm=False)
    two = LLM(path, verbose=False, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in two.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in one]
    finally:
        two.close()
