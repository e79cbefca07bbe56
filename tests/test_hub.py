"""Hugging Face Hub ids as models: resolved from a pre-filled local cache (never the network in tests), HF_HUB_OFFLINE
honoured, a clear error when neither the cache nor the Hub has it; the CLI and the offline API refuse a max_tokens
the context cannot hold, and a max_model_len past the model's own limit."""

import os
import shutil
import subprocess
import sys

import pytest

from hylo import LLM, SamplingParams


def _fill_cache(cache: str, repo: str, src: str, commit: str = "0123456789abcdef0123456789abcdef01234567") -> None:
    """The Hub cache's layout for one snapshot: models--ORG--NAME/{refs/main, snapshots/<commit>/<files>}."""
    base = os.path.join(cache, "models--" + repo.replace("/", "--"))
    os.makedirs(os.path.join(base, "refs"))
    with open(os.path.join(base, "refs", "main"), "w") as f:
        f.write(commit)
    shutil.copytree(src, os.path.join(base, "snapshots", commit))


def test_hub_id_from_the_local_cache(tmp_path, monkeypatch, ckpt_a):
    cache = str(tmp_path / "hub")
    _fill_cache(cache, "someorg/tiny-qwen3-next", ckpt_a)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM("someorg/tiny-qwen3-next", verbose=False)
    assert llm.engine.model_name == "someorg/tiny-qwen3-next"
    ref = LLM(ckpt_a, verbose=False)
    p = SamplingParams(max_tokens=5, temperature=0)
    assert llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].token_ids == \
        ref.generate([[1, 2, 3]], p, use_tqdm=False)[0].token_ids


def test_missing_hub_id_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="'nobody/nothing' is not a directory and could not be found in the "
                                                "local Hugging Face cache"):
        LLM("nobody/nothing", verbose=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "no" / "such" / "dir"), verbose=False)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "hylo", "generate", "--model", "nobody/nothing", "hi"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "nobody/nothing" in out.stderr


def test_max_tokens_past_the_context_and_max_model_len_past_the_model(ckpt_a):
    llm = LLM(ckpt_a, verbose=False, max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens is 100, but the prompt has 3 tokens and the context limit "
                                         r"\(max_model_len\) is 64: at most 61 tokens fit"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="more than the model's limit"):
        LLM(ckpt_a, verbose=False, max_model_len=10 ** 7)
    out = subprocess.run([sys.executable, "-m", "hylo", "generate", "--model", "hylo-default-random",
                          "--max-model-len", "40", "--max-tokens", "500", "--prompt", "x"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "max_tokens is 500" in out.stderr and "Traceback" not in out.stderr
