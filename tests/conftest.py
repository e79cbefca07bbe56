"""Shared fixtures: tiny Qwen3-Next, Qwen3.5 and Nemotron-H checkpoints written by transformers' own
``save_pretrained``."""

import pytest

from helpers import Q35, append_mtp, make_hf_checkpoint


@pytest.fixture(scope="session", autouse=True)
def check_every_checkpoints_headers():
    """Every checkpoint a test loads in this process goes through the header check before loading (hylo runs it
    from 1 GiB on; the tests' checkpoints are a few MB), so the check is tried on every family, form and reader."""
    from hylo.engine import loading

    saved, loading.HEADER_CHECK_MIN_BYTES = loading.HEADER_CHECK_MIN_BYTES, 0
    yield
    loading.HEADER_CHECK_MIN_BYTES = saved


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



# Qwen3.5: the released (vision-language) form and the text-only form, dense and MoE
@pytest.fixture(scope="session")
def q35_dense_vl(tmp_path_factory):
    from helpers import make_qwen35_checkpoint

    return make_qwen35_checkpoint(str(tmp_path_factory.mktemp("q35_dense_vl")), "dense", "vl")


@pytest.fixture(scope="session")
def q35_moe_text(tmp_path_factory):
    from helpers import make_qwen35_checkpoint

    return make_qwen35_checkpoint(str(tmp_path_factory.mktemp("q35_moe_text")), "moe", "text")


@pytest.fixture(scope="session")
def q35_dense_text(tmp_path_factory):
    from helpers import make_qwen35_checkpoint

    return make_qwen35_checkpoint(str(tmp_path_factory.mktemp("q35_dense_text")), "dense", "text")


@pytest.fixture(scope="session")
def q35_moe_vl(tmp_path_factory):
    from helpers import make_qwen35_checkpoint

    return make_qwen35_checkpoint(str(tmp_path_factory.mktemp("q35_moe_vl")), "moe", "vl")


@pytest.fixture(scope="session", params=list(Q35))
def q35(request):
    """(path, kind, form) of each Qwen3.5 checkpoint form."""
    fixture, kind, form = Q35[request.param]
    return request.getfixturevalue(fixture), kind, form


@pytest.fixture(scope="session")
def nemotron_h(tmp_path_factory):
    """(path, transformers model) of a tiny Nemotron-H (Mamba2 hybrid)."""
    from helpers import make_nemotron_h_checkpoint

    return make_nemotron_h_checkpoint(str(tmp_path_factory.mktemp("nemotron_h")))


@pytest.fixture(scope="session")
def nemotron3(tmp_path_factory):
    """(path, transformers model) of a tiny Nemotron 3 (Nemotron-H with MoE blocks of non-gated experts)."""
    from helpers import make_nemotron3_checkpoint

    return make_nemotron3_checkpoint(str(tmp_path_factory.mktemp("nemotron3")))


@pytest.fixture(scope="session")
def nemotron_mtp(tmp_path_factory):
    """(path, the target's transformers model, the MTP blocks' transformers model, the fusion weights) of a tiny
    Nemotron 3 with MTP layers as Nemotron 3 Super names them."""
    from helpers import make_nemotron3_mtp_checkpoint

    return make_nemotron3_mtp_checkpoint(str(tmp_path_factory.mktemp("n3mtp") / "ckpt"))


@pytest.fixture(scope="session")
def granite_hybrid(tmp_path_factory):
    """(path, transformers model) of a tiny Granite-4.0-H (Mamba2 hybrid with MoE and muP multipliers)."""
    from helpers import make_granite_hybrid_checkpoint

    return make_granite_hybrid_checkpoint(str(tmp_path_factory.mktemp("granite_hybrid")))


@pytest.fixture(scope="session")
def falcon_h1(tmp_path_factory):
    """(path, transformers model) of a tiny Falcon-H1 (attention and Mamba2 side by side, muP multipliers)."""
    from helpers import make_falcon_h1_checkpoint

    return make_falcon_h1_checkpoint(str(tmp_path_factory.mktemp("falcon_h1")))
