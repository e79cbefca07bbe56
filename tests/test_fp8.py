"""Block-FP8 checkpoints: the quantize / dequantize references, checkpoints written by tools/quantize_fp8.py in the
layout of Qwen's FP8 releases and loaded by both hylo and transformers (which dequantizes them on the CPU), the
embedded default's quality in FP8, and the refusal of every quantized checkpoint hylo cannot run, before any weight
is read."""

import importlib.util
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import load_hf, load_hf_qwen35, random_prompts, vocab_of
from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.layers.weights import CheckpointError, DictReader
from hylo.models.default import trained_default_path
from hylo.models.loader import SafetensorsReader
from hylo.models.quant import Fp8BlockReader, parse_quantization
from hylo.ops.fp8 import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _tool():
    spec = importlib.util.spec_from_file_location("quantize_fp8", os.path.join(ROOT, "tools", "quantize_fp8.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def quantize(src, dst, block, **kw):
    return _tool().quantize_checkpoint(str(src), str(dst), block, log=lambda m: None, **kw)


# ---- the references ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((70, 45), (32, 16)), ((3, 17, 40), (8, 128)), ((64, 64), (64, 64))])
def test_dequantize_is_q_times_its_blocks_scale_with_partial_edge_blocks(shape, block):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.linspace(0.01, 3, shape[-1])
    q, scale = quantize_fp8_block(w, block)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    bn, bk = block
    assert scale.shape == (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))
    deq = dequantize_fp8_block(q, scale, block)
    qf = q.float()
    for idx in range(deq.numel()):  # element by element: q times the scale of the block it lies in
        *lead, i, j = torch.unravel_index(torch.tensor(idx), deq.shape)
        lead = tuple(int(x) for x in lead)
        assert deq[lead + (i, j)] == qf[lead + (i, j)] * scale[lead + (int(i) // bn, int(j) // bk)]
        if idx > 400:
            break
    torch.testing.assert_close(deq, qf * scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)
                               [..., :shape[-2], :shape[-1]], rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, or of the block's smallest normal step
    err = (deq - w).abs()
    bound = w.abs() / 16 + scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :shape[-2], :shape[-1]] * 2 ** -9
    assert (err <= bound + 1e-7).all()
    # each block's largest magnitude lands on the format's largest value
    assert q.float().abs().max() == 448


def test_zero_blocks_and_wrong_scale_shapes():
    w = torch.zeros(8, 8)
    w[:4, :4] = 1.0
    q, scale = quantize_fp8_block(w, (4, 4))
    assert torch.equal(scale, torch.tensor([[1 / 448, 1.0], [1.0, 1.0]]))
    assert torch.equal(dequantize_fp8_block(q, scale, (4, 4)), w)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8_block(q, scale[:1], (4, 4))


# ---- checkpoints both hylo and transformers load -------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_a(tmp_path_factory, ckpt_a):
    dst = tmp_path_factory.mktemp("fp8_a") / "m"
    stats = quantize(ckpt_a, dst, (8, 16))  # every quantized dim a multiple: transformers' dequantizer needs it
    assert stats["quantized"] > 10 and stats["bytes_out"] < stats["bytes_in"]
    return str(dst)


def test_the_tool_writes_qwens_release_layout(fp8_a, ckpt_a):
    cfg = json.load(open(os.path.join(fp8_a, "config.json")))
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [8, 16] and qc["activation_scheme"] == "dynamic"
    t = load_file(os.path.join(fp8_a, "model.safetensors"))
    name = "model.layers.0.linear_attn.out_proj.weight"
    assert t[name].dtype == FP8_DTYPE and t[name + "_scale_inv"].dtype == torch.float32
    assert t["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == FP8_DTYPE
    assert t["model.layers.3.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.linear_attn.in_proj_ba.weight", "model.layers.0.linear_attn.conv1d.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight", "model.norm.weight"):
        assert t[kept].dtype == torch.float32 and kept + "_scale_inv" not in t, kept
    assert "model.layers.0.mlp.gate" in qc["modules_to_not_convert"]
    assert os.path.isfile(os.path.join(fp8_a, "generation_config.json"))


def test_fp8_qwen3_next_matches_transformers_on_the_same_files(fp8_a, ckpt_a):
    hf = load_hf(fp8_a)  # transformers dequantizes block FP8 on a machine without a GPU
    llm = LLM(fp8_a, verbose=False)
    assert llm.engine.model_config.quantization.block == (8, 16)
    for prompt in random_prompts(vocab_of(fp8_a), [1, 9, 23], seed=4):
        ref = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(llm.engine.prompt_logits(prompt).float(), ref, atol=2e-4, rtol=1e-4)
    # and it is a different model from the unquantized one (the FP8 rounding is really there)
    bf = LLM(ckpt_a, verbose=False)
    prompt = random_prompts(vocab_of(fp8_a), [12], seed=5)[0]
    assert (bf.engine.prompt_logits(prompt) - llm.engine.prompt_logits(prompt)).abs().max() > 1e-4


def test_fp8_qwen35_moe_released_form_with_fused_mtp_experts(tmp_path, q35_moe_vl):
    dst = tmp_path / "m"
    quantize(q35_moe_vl, dst, (4, 4))
    t = load_file(os.path.join(dst, "model.safetensors"))
    assert t["mtp.layers.0.mlp.experts.gate_up_proj"].dtype == FP8_DTYPE  # fused, 3-D: per-expert blocks
    assert t["mtp.layers.0.mlp.experts.gate_up_proj_scale_inv"].dim() == 3
    assert not any(k.endswith("_scale_inv") and ".visual." in k for k in t)
    hf = load_hf_qwen35(str(dst), "moe", "vl")
    llm = LLM(str(dst), verbose=False)
    prompt = random_prompts(vocab_of(str(dst)), [15], seed=6)[0]
    ref = hf(input_ids=torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(llm.engine.prompt_logits(prompt).float(), ref, atol=2e-4, rtol=1e-4)
    # the quantized MTP head drafts, and greedy speculation stays lossless
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    spec = LLM(str(dst), verbose=False, speculative="mtp", num_speculative_tokens=2)
    assert spec.generate([prompt], params, use_tqdm=False)[0].token_ids == plain


def test_sharded_fp8_checkpoint_and_keep_mtp(tmp_path, ckpt_a_mtp):
    src = tmp_path / "sharded"
    shutil.copytree(ckpt_a_mtp, src)
    tensors = load_file(src / "model.safetensors")
    os.remove(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, src / fn, metadata={"format": "pt"})
        weight_map.update({n: fn for n in part})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(src / "model.safetensors.index.json", "w"))
    dst = tmp_path / "fp8"
    quantize(src, dst, (8, 16), keep_mtp=True)
    index = json.load(open(dst / "model.safetensors.index.json"))["weight_map"]
    assert index["model.layers.0.linear_attn.out_proj.weight_scale_inv"] == index[
        "model.layers.0.linear_attn.out_proj.weight"]
    assert not any(k.startswith("mtp.") and k.endswith("_scale_inv") for k in index)
    eng = Engine(str(dst), engine_config=EngineConfig(verbose=False))
    assert not eng.reader.unused(ignore_prefixes=("mtp.",))  # every scale counted as read with its weight
    one = Engine(str(src), engine_config=EngineConfig(verbose=False))
    prompt = random_prompts(vocab_of(str(src)), [10], seed=7)[0]
    assert (eng.prompt_logits(prompt) - one.prompt_logits(prompt)).abs().max() > 1e-4


def test_a_tensor_parallel_rank_reads_its_slice_of_the_dequantized_weight(fp8_a):
    from hylo.models.registry import read_config
    from hylo.parallel.sharding import ShardedReader

    mc = read_config(fp8_a)
    full = Fp8BlockReader(SafetensorsReader(fp8_a), mc.quantization.block)
    for rank in range(2):
        sharded = ShardedReader(Fp8BlockReader(SafetensorsReader(fp8_a), mc.quantization.block), mc, rank, 2)
        for name, dim in (("model.layers.0.linear_attn.out_proj.weight", 1),
                          ("model.layers.3.self_attn.q_proj.weight", 0)):
            whole = full.get(name)
            size = whole.shape[dim] // 2
            assert torch.equal(sharded.get(name), whole.narrow(dim, rank * size, size))


def test_embedded_default_in_fp8_keeps_its_heldout_loss_and_most_greedy_tokens(tmp_path):
    """The issue's quality bar: held-out loss within 1% of the unquantized model, greedy tokens mostly the same
    (the rates are printed for the record)."""
    dst = tmp_path / "default_fp8"
    quantize(trained_default_path(), dst, (128, 128))
    bf, q8 = LLM(verbose=False), LLM(str(dst), verbose=False)
    with open(os.path.join(trained_default_path(), "heldout_sample.txt")) as f:
        ids = bf.tokenizer.encode(f.read())

    def loss(llm):
        return torch.nn.functional.cross_entropy(llm.engine.prompt_logits(ids)[:-1].float(),
                                                 torch.tensor(ids[1:])).item()

    a, b = loss(bf), loss(q8)
    assert abs(b - a) / a < 0.01, (a, b)
    # the greedy choice at each held-out position (teacher forced: one divergence does not count twice)
    same = (bf.engine.prompt_logits(ids).argmax(-1) == q8.engine.prompt_logits(ids).argmax(-1)).float().mean().item()
    # and free-running greedy decoding, up to the first divergence
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [ids[i:i + 24] for i in range(0, 240, 60)]
    runs = zip(bf.generate(prompts, params, use_tqdm=False), q8.generate(prompts, params, use_tqdm=False))
    prefix = [next((i for i, (x, y) in enumerate(zip(r.token_ids, g.token_ids)) if x != y), 40) for r, g in runs]
    print(f"FP8 default: held-out loss {a:.4f} -> {b:.4f} ({(b - a) / a:+.2%}), greedy agreement per position "
          f"{same:.3f}, free-running tokens before the first divergence {prefix}")
    assert same > 0.9


# ---- refusals, before any weight is read ---------------------------------------------------------------------------
@pytest.fixture
def no_weight_reads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(SafetensorsReader, "_load", refuse)
    monkeypatch.setattr(SafetensorsReader, "get_part", refuse)


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.update(changes)
    for k, v in list(cfg.items()):
        if v is None:
            del cfg[k]
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, "quantization method 'awq' is not supported"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "'ue8m0'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
])
def test_unsupported_quantization_configs_are_refused_by_name(tmp_path, ckpt_a, no_weight_reads, qc, match):
    path = _with_config(ckpt_a, tmp_path / "m", quantization_config=qc)
    with pytest.raises(ValueError, match=match):
        Engine(path, engine_config=EngineConfig(verbose=False))


def test_quantized_tensors_that_do_not_match_the_config_are_refused(tmp_path, fp8_a, ckpt_a, no_weight_reads):
    # FP8 tensors, the config's quantization_config removed
    path = _with_config(fp8_a, tmp_path / "noconfig", quantization_config=None)
    with pytest.raises(CheckpointError, match="is quantized, but config.json has no quantization_config"):
        Engine(path, engine_config=EngineConfig(verbose=False))
    # a block size other than the one the scales were made with
    qc = json.load(open(os.path.join(fp8_a, "config.json")))["quantization_config"]
    path = _with_config(fp8_a, tmp_path / "block", quantization_config={**qc, "weight_block_size": [16, 16]})
    with pytest.raises(CheckpointError, match="_scale_inv' has shape"):
        Engine(path, engine_config=EngineConfig(verbose=False))


def test_fp8_weights_without_scales_and_foreign_quantized_names_are_refused(tmp_path, fp8_a, ckpt_a):
    qc = parse_quantization(json.load(open(os.path.join(fp8_a, "config.json"))))
    t = load_file(os.path.join(fp8_a, "model.safetensors"))
    from hylo.models.quant import check_tensors

    lost = {k: v for k, v in t.items() if k != "model.layers.0.linear_attn.out_proj.weight_scale_inv"}
    with pytest.raises(CheckpointError, match="out_proj.weight' is float8_e4m3fn without its scales"):
        check_tensors(DictReader(lost), qc)
    extra = {**t, "model.layers.0.linear_attn.out_proj.input_scale": torch.ones(())}
    with pytest.raises(CheckpointError, match="input_scale' belongs to a quantization scheme"):
        check_tensors(DictReader(extra), qc)
    plain = load_file(os.path.join(ckpt_a, "model.safetensors"))
    gptq = {**plain, "model.layers.0.mlp.down_proj.qweight": torch.zeros(2, 2, dtype=torch.int32)}
    with pytest.raises(CheckpointError, match="qweight"):
        check_tensors(DictReader(gptq), None)
    check_tensors(DictReader(plain), None)  # an unquantized checkpoint passes
    # scales stored as integers (UE8M0 bytes, int8) would be multiplied in as the numbers they hold
    scale = "model.layers.0.linear_attn.out_proj.weight_scale_inv"
    for dtype in (torch.uint8, torch.int8):
        ints = {**t, scale: torch.full(t[scale].shape, 120, dtype=dtype)}
        with pytest.raises(CheckpointError, match=f"{scale}' is stored as {str(dtype)[6:]}: hylo reads block-FP8"):
            check_tensors(DictReader(ints), qc)
    # a vector in FP8 with a scale (a norm): named, not a bare unpacking error
    norm = {**t, "model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn),
            "model.norm.weight_scale_inv": torch.ones(1)}
    with pytest.raises(CheckpointError, match="'model.norm.weight' of shape .* block FP8 quantizes matrices"):
        check_tensors(DictReader(norm), qc)


def test_a_quantization_config_that_contradicts_the_text_models_is_refused():
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    cfg = {"quantization_config": qc, "text_config": {"quantization_config": {"quant_method": "awq"}}}
    with pytest.raises(ValueError, match="disagree"):
        parse_quantization(cfg)
    cfg["text_config"]["quantization_config"] = dict(qc)  # the same config in both places is no contradiction
    assert parse_quantization(cfg).block == (128, 128)


# ---- FP8 kept in memory (the GPU's layout), through the reference ops -------------------------------------------
def _fp8_params(model):
    from hylo.ops.fp8 import Fp8Weight

    return [m for m in model.modules() if isinstance(m, Fp8Weight)]


@pytest.mark.parametrize("which", ["qwen3_next", "qwen3_5_moe"])
def test_fp8_weights_kept_in_memory_compute_what_dequantized_ones_do(which, fp8_a, tmp_path, q35_moe_vl,
                                                                     monkeypatch):
    """HYLO_FP8_WEIGHTS=keep (the default on a GPU) keeps every projection FP8 with its block scales, re-laid as
    hylo fuses them (attention q|gate|k|v, GDN q|k|v|z with b|a apart, gate|up, experts with the shared one); the
    model computes what the one dequantized at load computes, MTP included."""
    if which == "qwen3_next":
        path = fp8_a
    else:
        path = str(tmp_path / "m")
        quantize(q35_moe_vl, path, (4, 4))
    monkeypatch.setenv("HYLO_FP8_WEIGHTS", "keep")
    kept = LLM(path, verbose=False)
    model = kept.engine.model
    assert kept.engine.model_config.quantization.keep
    fp8 = _fp8_params(model)
    layer0 = model.layers[0]
    assert layer0.mixer.in_proj in fp8 and layer0.mixer.out_proj in fp8
    assert layer0.mixer.in_proj_ba.dtype != FP8_DTYPE
    attn = next(layer for layer in model.layers if not layer.is_linear)
    assert attn.mixer.qkv_proj in fp8 and attn.mixer.o_proj in fp8
    assert any(getattr(layer.mlp, "w13", None) in fp8 for layer in model.layers)
    fp8_bytes = sum(w.q.numel() for w in fp8)
    monkeypatch.setenv("HYLO_FP8_WEIGHTS", "dequantize")
    deq = LLM(path, verbose=False)
    assert not _fp8_params(deq.engine.model) and not deq.engine.model_config.quantization.keep
    assert fp8_bytes > 0.8 * sum(p.numel() for n, p in deq.engine.model.named_parameters()
                                 if "embed" not in n and "lm_head" not in n and "router" not in n
                                 and "norm" not in n and "conv" not in n and p.dim() >= 2 and "in_proj_ba" not in n)
    prompt = random_prompts(vocab_of(path), [13], seed=8)[0]
    torch.testing.assert_close(kept.engine.prompt_logits(prompt), deq.engine.prompt_logits(prompt), atol=1e-4,
                               rtol=1e-4)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert (kept.generate([prompt], params, use_tqdm=False)[0].token_ids
            == deq.generate([prompt], params, use_tqdm=False)[0].token_ids)
    if which == "qwen3_5_moe":
        monkeypatch.setenv("HYLO_FP8_WEIGHTS", "keep")
        spec = LLM(path, verbose=False, speculative="mtp", num_speculative_tokens=2)
        assert _fp8_params(spec.engine.worker.drafter.mtp)  # the MTP head's layers are FP8 too
        assert spec.generate([prompt], params, use_tqdm=False)[0].token_ids == deq.generate(
            [prompt], params, use_tqdm=False)[0].token_ids


def test_fp8_weights_setting_is_checked(monkeypatch, fp8_a):
    monkeypatch.setenv("HYLO_FP8_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="HYLO_FP8_WEIGHTS='yes'"):
        LLM(fp8_a, verbose=False)


def test_fp8_blocks_the_kernels_cannot_tile_are_dequantized_at_load_on_a_gpu(monkeypatch):
    """On a GPU, "auto" keeps FP8 only for blocks whose columns the kernels tile (a power of two, at least 16):
    another block would be dequantized whole at every step, so it is dequantized once at load; "keep" still
    keeps it (the reference path), and the CPU dequantizes at load whatever the block."""
    from hylo.models.quant import keep_fp8

    monkeypatch.delenv("HYLO_FP8_WEIGHTS", raising=False)
    assert keep_fp8("cuda", (128, 128)) and keep_fp8("cuda", (16, 16))
    assert not keep_fp8("cuda", (128, 96)) and not keep_fp8("cuda", (8, 8)) and not keep_fp8("cpu", (128, 128))
    monkeypatch.setenv("HYLO_FP8_WEIGHTS", "keep")
    assert keep_fp8("cuda", (128, 96)) and keep_fp8("cpu", (128, 96))


def test_fp8_weights_kept_in_memory_under_tensor_parallelism(fp8_a, monkeypatch):
    """Each rank keeps its slice of every FP8 weight with the slice's block scales (a slice that starts inside a
    block is kept in the compute dtype instead); two ranks give one rank's tokens."""
    monkeypatch.setenv("HYLO_FP8_WEIGHTS", "keep")  # the ranks' processes inherit it
    prompts = random_prompts(vocab_of(fp8_a), [5, 17, 9], seed=42)
    params = SamplingParams(max_tokens=10, temperature=0)
    one = LLM(fp8_a, verbose=False, chunk_size=16)
    two = LLM(fp8_a, verbose=False, chunk_size=16, tensor_parallel_size=2)
    try:
        assert len(_fp8_params(two.engine.model)) >= 8  # rank 0's slices
        assert ([o.token_ids for o in two.generate(prompts, params, use_tqdm=False)]
                == [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)])
    finally:
        two.close()


def test_the_converter_refuses_bad_paths_in_one_line(tmp_path, ckpt_a):
    """Bad inputs end the tool with one line naming the problem (not a traceback), before anything is written; the
    output is never the source, and a non-empty output is replaced only with --force, stale shards removed."""
    tool = _tool()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_text("{nope")
    for src, dst, match in [(tmp_path / "missing", tmp_path / "o1", "not a directory"),
                            (tmp_path / "afile", tmp_path / "o1", "not a directory"),
                            (tmp_path, tmp_path / "o1", "no config.json"),
                            (tmp_path / "badcfg", tmp_path / "o1", "not valid JSON"),
                            (ckpt_a, tmp_path / "afile", "not a directory"),
                            (ckpt_a, os.path.join(ckpt_a, "..", os.path.basename(ckpt_a)), "is the source")]:
        with pytest.raises(SystemExit, match=match):
            tool.main([str(src), str(dst)])
    assert not (tmp_path / "o1").exists()
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale-00009.safetensors").write_text("old")
    with pytest.raises(SystemExit, match="not empty"):
        tool.main([str(ckpt_a), str(out)])
    assert tool.main([str(ckpt_a), str(out), "--force"]) == 0
    assert not (out / "stale-00009.safetensors").exists() and (out / "config.json").is_file()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    # a source that cannot be converted leaves a forced output as it was (nothing removed first)
    kept = sorted(os.listdir(out))
    for bad, match in ((out, "already quantized"), (tmp_path / "badcfg", "not valid JSON")):
        with pytest.raises(SystemExit, match=match):
            tool.main([str(bad), str(out), "--force"])
    again = tmp_path / "again"
    again.mkdir()
    (again / "keep.safetensors").write_text("mine")
    with pytest.raises(SystemExit, match="already quantized"):
        tool.main([str(out), str(again), "--force"])
    assert sorted(os.listdir(out)) == kept and (again / "keep.safetensors").read_text() == "mine"
