"""A checkpoint's own tokenizer.json and chat template: text in, text out, stop strings on real text."""

import json
import os
import shutil

import pytest

from hylo import LLM, SamplingParams
from hylo.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def ckpt_with_tokenizer(tmp_path_factory, ckpt_a):
    """Checkpoint a with a word-level tokenizer.json over its 160-token vocabulary and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    path = tmp_path_factory.mktemp("tok") / "m"
    shutil.copytree(ckpt_a, path)
    words = ["<unk>", "<|im_start|>", "<|im_end|>"] + [f"w{i}" for i in range(157)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": "{% for m in messages %}<|im_start|> {{ m['content'] }} <|im_end|> "
                                    "{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}"}, f)
    return str(path)


def test_text_prompts_and_stop_strings_with_the_checkpoint_tokenizer(ckpt_with_tokenizer):
    llm = LLM(ckpt_with_tokenizer, verbose=False)
    tok = llm.tokenizer
    assert tok.encode("w5 w7 w9") == [8, 10, 12]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = llm.generate("w1 w2 w3", params, use_tqdm=False)[0]
    assert out.prompt_token_ids == [4, 5, 6]
    assert out.text == tok.decode(out.token_ids)
    words = out.text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut = llm.generate("w1 w2 w3", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text == out.text[:out.text.index(stop)]


def test_chat_template_from_the_checkpoint_and_the_chatml_default(ckpt_with_tokenizer):
    tok = load_tokenizer(ckpt_with_tokenizer)
    text = tok.apply_chat_template([{"role": "user", "content": "w3 w4"}])
    assert text == "<|im_start|> w3 w4 <|im_end|> <|im_start|>"
    assert tok.encode(text)[:1] == [1] and tok.special_ids == {1, 2}
    byte = ByteTokenizer()
    chat = byte.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = byte.encode(chat)
    assert ids[0] == byte.token_id("<|im_start|>") and byte.decode(ids) == "user\nhi\nassistant\n"


def test_a_broken_tokenizer_config_or_template_is_named(tmp_path, ckpt_with_tokenizer, capsys):
    """tokenizer_config.json that is not JSON, or whose chat_template is neither a string nor named templates, is
    an error naming that file (tokenizer.json is fine); a template that does not compile loads with a warning, and
    chat then fails as the model's fault (a 500 naming the template), while completions serve."""
    from hylo.server.app import create_app
    from hylo.tokenizer import ChatTemplateError

    for text, words in (("{not json", "tokenizer_config.json is not valid JSON"),
                        (json.dumps({"chat_template": ["a", "b"]}), "chat_template must be a string or a list")):
        bad = tmp_path / words[:10].replace(" ", "_")
        shutil.copytree(ckpt_with_tokenizer, bad)
        (bad / "tokenizer_config.json").write_text(text)
        with pytest.raises(ValueError, match=words):
            load_tokenizer(str(bad))
    broken = tmp_path / "broken"
    shutil.copytree(ckpt_with_tokenizer, broken)
    (broken / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    tok = load_tokenizer(str(broken))
    assert "chat template does not compile" in capsys.readouterr().err
    with pytest.raises(ChatTemplateError, match="line 1"):
        tok.apply_chat_template([{"role": "user", "content": "w1"}])
    from fastapi.testclient import TestClient

    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine

    with TestClient(create_app(Engine(str(broken), engine_config=EngineConfig(verbose=False)))) as http:
        chat = http.post("/v1/chat/completions", json={"max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "w1"}]})
        done = http.post("/v1/completions", json={"max_tokens": 2, "prompt": "w1 w2"})
    assert chat.status_code == 500 and "chat template does not compile" in chat.json()["error"]["message"]
    assert done.status_code == 200


def test_real_qwen3_next_style_config_parses():
    """The original Qwen3-Next config.json layout: top-level rope_theta / partial_rotary_factor,
    full_attention_interval instead of layer_types; rope scaling is refused by name."""
    from hylo.models.registry import parse_config

    cfg = {"model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
           "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "rope_theta": 10000000,
           "partial_rotary_factor": 0.25, "full_attention_interval": 4, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
           "shared_expert_intermediate_size": 512, "intermediate_size": 5120, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "rope_scaling": None, "eos_token_id": 151645}
    mc = parse_config(cfg)
    assert mc.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert mc.rotary_dim == 64 and mc.rope_theta == 1e7 and mc.eos_token_ids == (151645,)
    with pytest.raises(ValueError, match="rope_scaling"):
        parse_config({**cfg, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type"):
        parse_config({**cfg, "model_type": "llama"})


def test_a_bos_tokenizer_adds_its_bos_to_prompts_and_never_twice_to_chat(tmp_path, ckpt_with_tokenizer):
    """A tokenizer whose post-processor adds a BOS (Llama-style): plain prompts get it, a rendered chat template
    (which writes its own) is encoded without it, as vLLM and HF's apply_chat_template(tokenize=True) do."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer, processors

    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine
    from hylo.server.app import create_app

    path = tmp_path / "bos"
    shutil.copytree(ckpt_with_tokenizer, path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tok.save(str(path / "tokenizer.json"))
    engine = Engine(str(path), device="cpu", engine_config=EngineConfig(verbose=False))
    with TestClient(create_app(engine)) as http:
        plain = http.post("/tokenize", json={"prompt": "w3 w4", "return_token_strs": True}).json()
        assert plain["tokens"] == [1, 6, 7] and plain["token_strs"] == ["<|im_start|>", "w3", "w4"]
        assert http.post("/tokenize", json={"prompt": "w3", "add_special_tokens": False}).json()["tokens"] == [6]
        msgs = [{"role": "user", "content": "w3"}]
        chat = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        assert chat == [1, 6, 2, 1]
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "return_token_ids": True})
        assert r.json()["prompt_token_ids"] == chat
        r = http.post("/v1/completions", json={"prompt": "w3", "max_tokens": 2, "return_token_ids": True})
        assert r.json()["choices"][0]["prompt_token_ids"] == [1, 6]


def test_a_template_writes_the_tokenizers_own_bos_and_eos(tmp_path, ckpt_with_tokenizer):
    """``{{ bos_token }}`` and ``{{ eos_token }}`` in a chat template are tokenizer_config.json's tokens (a string or
    an added token's content), as transformers renders them: they were empty, so such a template lost its BOS and
    its turn ends."""
    from fastapi.testclient import TestClient

    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine
    from hylo.server.app import create_app

    path = tmp_path / "specials"
    shutil.copytree(ckpt_with_tokenizer, path)
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
                   "chat_template": template}, f)
    engine = Engine(str(path), device="cpu", engine_config=EngineConfig(verbose=False))
    assert (engine.tokenizer.bos_token, engine.tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    with TestClient(create_app(engine)) as http:
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "w3"}]}).json()["tokens"]
    assert chat == [1, 6, 2]


def test_token_bytes_of_a_sentencepiece_style_vocabulary(tmp_path):
    """The bytes a token stands for, which the constraint automata are built from: a Metaspace token keeps its
    leading space ("\u2581the" is b" the"), a byte fallback token is its byte ("<0x0A>" is b"\\n"), an added token
    is its own text; and a byte-level BPE vocabulary keeps reading through its byte alphabet."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xE2>": 2, "\u2581the": 3, "\u2581": 4, "t": 5, "h": 6, "e": 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_tokens([AddedToken("<tool>", special=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path))
    assert [t.token_bytes(i) for i in range(9)] == [b"<unk>", b"\n", b"\xe2", b" the", b" ", b"t", b"h", b"e",
                                                    b"<tool>"]
    byte_level = load_tokenizer(os.path.dirname(__file__) + "/../hylo/models/default_ckpt")
    space_a = byte_level.encode(" a")
    assert b"".join(byte_level.token_bytes(i) for i in space_a) == b" a"
