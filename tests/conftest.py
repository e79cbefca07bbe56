"""Shared fixtures: tiny Qwen3-Next checkpoints written by transformers' own ``save_pretrained``."""

import pytest

from helpers import append_mtp, make_hf_checkpoint


@pytest.fixture(scope="session")
def ckpt_a(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("ckpt_a")), "a")


@pytest.fixture(scope="session")
def ckpt_b(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("ckpt_b")), "b")


@pytest.fixture(scope="session", params=["a", "b"])
def ckpt(request, ckpt_a, ckpt_b):
    return {"a": ckpt_a, "b": ckpt_b}[request.param]


@pytest.fixture(scope="session")
def ckpt_a_mtp(tmp_path_factory, ckpt_a):
    return append_mtp(ckpt_a, str(tmp_path_factory.mktemp("ckpt_a_mtp") / "m"))


@pytest.fixture(scope="session")
def ckpt_b_mtp(tmp_path_factory, ckpt_b):
    return append_mtp(ckpt_b, str(tmp_path_factory.mktemp("ckpt_b_mtp") / "m"))

