"""Checkpoints, options and calls that a fuzz of the loader, the CLI and the offline API (session 29: about 300
cases) found loaded and computing garbage, or ending in a traceback. Each is now refused with an error that names
the file and the field, before any weight is read where the problem is in the config or the files' headers."""

import json
import os
import shutil
import threading

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.cli import main as cli_main
from hylo.layers.weights import CheckpointError
from hylo.models.registry import has_mtp_head, read_config

DEFAULT = os.path.join(os.path.dirname(__file__), "..", "hylo", "models", "default_ckpt")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _copy(tmp_path, name="ckpt") -> str:
    out = tmp_path / name
    shutil.copytree(DEFAULT, out)
    return str(out)


def _edit_config(path: str, change, file="config.json") -> None:
    with open(os.path.join(path, file)) as f:
        cfg = json.load(f)
    cfg = change(cfg)
    with open(os.path.join(path, file), "w") as f:
        f.write(cfg if isinstance(cfg, str) else json.dumps(cfg))


def _set(**kv):
    def change(cfg):
        cfg.update(kv)
        return cfg
    return change


def _rope(**kv):
    def change(cfg):
        cfg["rope_parameters"].update(kv)
        return cfg
    return change


@pytest.mark.parametrize("change,words", [
    (_set(rms_norm_eps=-1.0), "rms_norm_eps must be a positive finite number"),
    (lambda c: json.dumps(c).replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'), "rms_norm_eps must be"),
    (_rope(rope_theta=-1.0), "rope_parameters.rope_theta must be a positive finite number"),
    (_rope(partial_rotary_factor=2.0), "partial_rotary_factor must be in (0, 1]"),
    (_set(hidden_size=256.7), "hidden_size must be an integer"),
    (_set(hidden_size=True), "hidden_size must be an integer"),
    (_set(hidden_size=float("inf")), "hidden_size must be an integer"),  # (JSON's Infinity)
    (_set(head_dim=float("nan")), "head_dim must be an integer"),
    (_set(hidden_size=-8), "hidden_size must be an integer in [1,"),
    (_set(head_dim=0), "head_dim must be an integer in [1,"),
    (_set(decoder_sparse_step=0), "decoder_sparse_step must be an integer in [1,"),
    (_set(num_hidden_layers=10 ** 9), "num_hidden_layers must be an integer in [1, 4096]"),
    (_set(vocab_size=10 ** 12), "vocab_size must be an integer"),
    (_set(norm_topk_prob="false"), "norm_topk_prob must be true or false, got 'false'"),  # (bool("false"))
    (_set(tie_word_embeddings=0), "tie_word_embeddings must be true or false"),
    (_set(mlp_only_layers="abc"), "mlp_only_layers must be a list of layer numbers"),
    (_set(mlp_only_layers=[0, 99]), "mlp_only_layers names layer 99"),
    (_set(eos_token_id=-1), "eos_token_id must be a token id"),
    (_set(eos_token_id=True), "eos_token_id must be a token id"),
    (_set(eos_token_id=999999), "eos_token_id 999999 is outside the vocabulary"),
    (lambda c: [1, 2], "config.json must hold a JSON object"),
    (lambda c: {k: v for k, v in c.items() if k != "num_attention_heads"}, "has no 'num_attention_heads'"),
    (lambda c: "{'model_type': ", "config.json is not valid JSON"),
    (_set(architectures=["LlamaForCausalLM"]), "are not Qwen3-Next classes"),
    (_set(architectures=["Qwen3_5ForConditionalGeneration"]), "the config contradicts itself"),
])
def test_a_config_value_that_would_build_another_model_is_refused(tmp_path, change, words):
    path = _copy(tmp_path)
    _edit_config(path, change)
    with pytest.raises(ValueError, match=None) as err:
        read_config(path)
    assert words in str(err.value)


@pytest.mark.parametrize("eos,words", [(-1, "eos_token_id must be a token id"),
                                       (100000, "outside the vocabulary"), ([0, None], "eos_token_id must be")])
def test_generation_config_eos_ids_are_checked(tmp_path, eos, words):
    path = _copy(tmp_path)
    _edit_config(path, _set(eos_token_id=eos), "generation_config.json")
    with pytest.raises(ValueError) as err:
        read_config(path)
    assert words in str(err.value)


def test_num_nextn_predict_layers_0_means_no_mtp_head(tmp_path):
    path = _copy(tmp_path)
    assert has_mtp_head(read_config(path))
    _edit_config(path, _set(num_nextn_predict_layers=0))
    assert not has_mtp_head(read_config(path))
    with pytest.raises(ValueError, match="multi-token-prediction head"):
        LLM(path, device="cpu", speculative="mtp", verbose=False)


def _count_weight_reads(monkeypatch) -> list[str]:
    """The names of the tensors read from checkpoint files from now on (whole or in part)."""
    from hylo.models.loader import SafetensorsReader

    reads, load, part = [], SafetensorsReader._load, SafetensorsReader.get_part
    monkeypatch.setattr(SafetensorsReader, "_load", lambda self, n: reads.append(n) or load(self, n))
    monkeypatch.setattr(SafetensorsReader, "get_part", lambda self, n, *a: reads.append(n) or part(self, n, *a))
    return reads


def _last_layer_wrong(tensors):  # the last tensor the loader reads, one row short
    name = "model.layers.7.mlp.shared_expert.down_proj.weight"
    tensors[name] = tensors[name][:-1]


@pytest.mark.parametrize("change,spec,words", [
    (_last_layer_wrong, None, "'model.layers.7.mlp.shared_expert.down_proj.weight' has shape"),
    (lambda t: t.pop("model.norm.weight"), None, "missing tensor 'model.norm.weight'"),
    (lambda t: t.pop("mtp.layers.0.self_attn.k_proj.weight"), "mtp", "missing tensor 'mtp.layers.0.self_attn.k_proj"),
    (lambda t: t.__setitem__("mtp.fc.weight", t["mtp.fc.weight"].T.contiguous()), "mtp", "'mtp.fc.weight' has shape"),
])
def test_a_tensor_missing_or_misshapen_anywhere_is_refused_before_any_weight_is_read(tmp_path, monkeypatch, change,
                                                                                    spec, words):
    """The header check loads the model (and the MTP head it will use) on the meta device from the files' headers:
    a problem in the last layer or the head is found before the first weight is read, not after the rest loaded."""
    path = _copy(tmp_path)
    _rewrite_weights(path, change)
    reads = _count_weight_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=words):
        LLM(path, device="cpu", speculative=spec, verbose=False)
    assert reads == []


def test_the_mtp_head_is_checked_only_where_it_is_used(tmp_path, monkeypatch):
    path = _copy(tmp_path)
    _rewrite_weights(path, lambda t: t.pop("mtp.norm.weight"))
    assert LLM(path, device="cpu", verbose=False).generate(["def f"], GREEDY)[0].token_ids  # no head asked for
    path = _copy(tmp_path, "no_head")
    _edit_config(path, _set(num_nextn_predict_layers=0))
    reads = _count_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match="multi-token-prediction head"):
        LLM(path, device="cpu", speculative="mtp", verbose=False)
    assert reads == []  # refused before the model loaded


def _rewrite_weights(path: str, change) -> None:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.int16])
def test_integer_or_boolean_weights_are_refused_before_loading(tmp_path, dtype):
    """They were cast to the compute dtype without a word (an int32 embedding generated token 0 forever)."""
    path = _copy(tmp_path)
    _rewrite_weights(path, lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].to(dtype)}))
    with pytest.raises(CheckpointError, match="'model.embed_tokens.weight' is stored as"):
        LLM(path, device="cpu", verbose=False)


def test_broken_weight_files_and_indexes_name_the_file(tmp_path):
    path = _copy(tmp_path, "truncated")
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        LLM(path, device="cpu", verbose=False)
    # an index whose shards lie outside the checkpoint's folder
    path = _copy(tmp_path, "outside")
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(tmp_path, "elsewhere.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}, f)
    with pytest.raises(CheckpointError, match="is not a file name in"):
        LLM(path, device="cpu", verbose=False)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(CheckpointError, match="has no weight_map"):
        LLM(path, device="cpu", verbose=False)


def test_a_corrupt_tokenizer_names_its_file(tmp_path):
    path = _copy(tmp_path)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write('{"truncated": [')
    with pytest.raises(ValueError, match="tokenizer.json cannot be read as a tokenizer"):
        LLM(path, device="cpu", verbose=False)


@pytest.fixture(scope="module")
def llm():
    with LLM(None, device="cpu", verbose=False) as model:
        yield model


def test_one_llm_from_two_threads_gives_each_its_own_tokens(llm):
    """Two threads' requests ran in each other's steps: mixed texts, or 'engine stopped with requests pending'."""
    prompts = [["import os\n", "def main("], ["class A:\n", "for i in range("]]
    want = [[o.token_ids for o in llm.generate(p, GREEDY, use_tqdm=False)] for p in prompts]
    got, errors = [None, None], []

    def run(i):
        try:
            for _ in range(3):
                got[i] = [o.token_ids for o in llm.generate(prompts[i], GREEDY, use_tqdm=False)]
                assert got[i] == want[i]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want


def test_offline_api_misuse_is_a_clear_error(llm):
    for bad in (None, 123, {"prompt": "x"}, b"bytes"):
        with pytest.raises(ValueError, match="prompts must be"):
            llm.generate(bad, GREEDY)
    with pytest.raises(TypeError, match="model must be a checkpoint directory"):
        LLM(123)
    with pytest.raises(ValueError, match="unsupported device 'tpu'"):
        LLM(None, device="tpu")
    with pytest.raises(ValueError, match="unsupported device 'cpu:1'"):
        LLM(None, device="cpu:1")
    n_cuda = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"'cuda:{n_cuda}' asked for"):
        LLM(None, device=f"cuda:{n_cuda}")
    with pytest.raises(ValueError, match="unsupported dtype"):
        LLM(None, device="cpu", dtype=torch.int8)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer"):
        LLM(None, device="cpu", max_num_seqs="4")
    with pytest.raises(ValueError, match="chunk_size must be an integer"):
        LLM(None, device="cpu", chunk_size=1.5)
    with pytest.raises(ValueError, match="more than the .* GiB free"):
        LLM(None, device="cpu", kv_cache_tokens=10 ** 12, verbose=False)
    for kw in (dict(stop=5), dict(stop_token_ids=5), dict(ignore_eos="yes")):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    closed = LLM(None, device="cpu", verbose=False)
    closed.close()
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        closed.generate("x", GREEDY)


def test_cli_prompt_mistakes_are_errors_not_tracebacks(tmp_path, capsys):
    assert cli_main(["generate", "--prompt-file", str(tmp_path), "--max-tokens", "2"]) == 2
    assert "--prompt-file" in capsys.readouterr().err
    assert cli_main(["generate", "abc", "--prompt", "other", "--max-tokens", "2"]) == 2
    assert "give the prompt once" in capsys.readouterr().err
    assert cli_main(["generate", "abc", "--device", "tpu", "--max-tokens", "2"]) == 2
    assert "unsupported device 'tpu'" in capsys.readouterr().err


def test_cli_reads_the_prompt_from_standard_input(monkeypatch, capsys):
    """--prompt-file - reads standard input: the same completion as the prompt given as text."""
    import io

    assert cli_main(["generate", "def f(x):", "--max-tokens", "4", "--model", "hylo-default-random"]) == 0
    want = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(x):"))
    assert cli_main(["generate", "--prompt-file", "-", "--max-tokens", "4", "--model", "hylo-default-random"]) == 0
    assert capsys.readouterr().out == want and want.strip() and not want.startswith("def f(x):")


@pytest.mark.parametrize("which", ["qwen3_next", "granite"])
def test_a_tie_flag_with_a_different_stored_head_uses_the_head(tmp_path, ckpt_a, ckpt_b, granite_hybrid, which):
    """config.json says tie_word_embeddings while the file holds its own lm_head.weight: where the two differ,
    transformers does not tie (the config is wrong) and computes with the stored head, and so does hylo; where they
    are equal the head is the embedding (one tensor in memory)."""
    from safetensors.torch import load_file, save_file

    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine

    src = granite_hybrid[0] if which == "granite" else next(p for p in (ckpt_a, ckpt_b)
                                                             if not read_config(p).tie_word_embeddings)
    want = Engine(src, engine_config=EngineConfig(verbose=False)).prompt_logits([3, 1, 4, 1, 5])
    bad = str(tmp_path / "tied")
    shutil.copytree(src, bad)
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({**cfg, "tie_word_embeddings": True}, f)
    eng = Engine(bad, engine_config=EngineConfig(verbose=False))
    assert eng.model_config.tie_word_embeddings is False
    assert torch.equal(eng.prompt_logits([3, 1, 4, 1, 5]), want)
    file = os.path.join(bad, "model.safetensors")
    tensors = load_file(file)
    embed = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors["lm_head.weight"] = tensors[embed].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    model = Engine(bad, engine_config=EngineConfig(verbose=False)).model
    assert model.config.tie_word_embeddings and model.lm_head is model.embed
