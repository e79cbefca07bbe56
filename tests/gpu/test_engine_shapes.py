"""The fast path on checkpoint shapes unlike bench-6b's: the two Qwen3-Next configs that transformers itself wrote
(tests/helpers.py: head sizes that are not powers of two, one to three value heads per key head, conv kernels of 3
and 4, a shared expert of the routed size and one of another, dense layers among MoE layers, biases, tied
embeddings, top-k without renormalisation) and two Qwen3.5 ones (a dense MLP in every layer; three value heads per
key head), and the three Mamba2 families'. The engine with the Triton kernels (and CUDA graphs, on a GPU) against
the same engine on the torch reference ops. On CUDA, or on CPU tensors through Triton's interpreter."""

import pytest
import torch

from hylo import SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.speculative.setup import SpecSetup

from helpers import random_prompts, vocab_of


def _engine(path, spec, dev):
    ec = EngineConfig(verbose=False, max_num_seqs=4, cuda_graph_sizes=(1, 2, 4), chunk_size=16,
                      **({"speculative": spec, "num_speculative_tokens": 3} if spec else {}))
    return Engine(path, device=dev, dtype="float32", engine_config=ec,
                  spec_setup=SpecSetup(spec) if spec else None)


def _generate(eng, prompts, n):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    rids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [eng.pop_finished(r).token_ids for r in rids]


CHECKPOINTS = {"a": "ckpt_a", "b": "ckpt_b", "a-mtp": "ckpt_a_mtp", "b-mtp": "ckpt_b_mtp",
               # Qwen3.5: a dense model in the released form (dense MLP in every layer, tied embeddings) and a MoE
               # model in the text-only form (its MTP experts stored fused); both carry an MTP head
               "q35-dense": "q35_dense_vl", "q35-moe": "q35_moe_text",
               # the Mamba2 families (the recurrence's steps in Triton; attention, MLPs, MoE, graphs and padding on
               # the fast path)
               "nemotron-h": "nemotron_h", "granite-h": "granite_hybrid", "falcon-h1": "falcon_h1",
               # Nemotron 3: MoE blocks of non-gated squared-ReLU experts (the expert kernels' gated=False mode)
               "nemotron-3": "nemotron3",
               # with MTP layers as Nemotron 3 Super ships them (the MTP drafter on a Mamba2 family), the shared
               # expert folded in as two more experts
               "nemotron-3-mtp": "nemotron_mtp"}


# block-FP8 copies (tools/quantize_fp8.py), kept FP8 in memory: the W8A16 kernels against the reference's
# whole-weight dequantization; blocks that the re-layouts keep whole and the kernels take (16 columns)
FP8_COPIES = {"a-mtp-fp8": ("ckpt_a_mtp", (8, 16)), "q35-moe-fp8": ("q35_moe_text", (4, 16))}


@pytest.fixture(scope="module")
def fp8_copies(tmp_path_factory):
    import importlib.util
    import os

    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "quantize_fp8.py")
    spec = importlib.util.spec_from_file_location("quantize_fp8", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    made = {}

    def get(name, request):
        if name not in made:
            src, block = FP8_COPIES[name]
            dst = str(tmp_path_factory.mktemp(name) / "m")
            mod.quantize_checkpoint(request.getfixturevalue(src), dst, block, log=lambda m: None)
            made[name] = dst
        return made[name]

    return get


@pytest.mark.parametrize("name,spec", [("a", None), ("b", None), ("a-mtp", "mtp"), ("b-mtp", "mtp"),
                                       ("q35-dense", None), ("q35-moe", None), ("q35-dense", "mtp"),
                                       ("q35-moe", "mtp"), ("a-mtp-fp8", None), ("a-mtp-fp8", "mtp"),
                                       ("q35-moe-fp8", "mtp"), ("nemotron-h", None), ("nemotron-h", "ngram"),
                                       ("granite-h", "ngram"), ("falcon-h1", "ngram"), ("nemotron-3", None),
                                       ("nemotron-3", "ngram"), ("nemotron-3-mtp", "mtp")])
def test_fast_path_on_other_shapes_matches_the_reference_ops(dev, name, spec, request, monkeypatch, fp8_copies):
    """Prompt logits (chunked prefill: 16-token chunks over a 37-token prompt) agree with the reference ops; a batch
    of three (padded to a captured 4 on a GPU) generates the reference's greedy tokens wherever the reference's
    top two logits are apart by more than float32 noise; with MTP speculative decoding too; and on FP8 copies whose
    weights stay FP8 in memory."""
    if name in FP8_COPIES:
        path = fp8_copies(name, request)
        monkeypatch.setenv("HYLO_FP8_WEIGHTS", "keep")
    else:
        path = request.getfixturevalue(CHECKPOINTS[name])
        path = path[0] if isinstance(path, tuple) else path  # (path, transformers model) fixtures
    prompts = random_prompts(vocab_of(path), [37, 5, 12], seed=9)
    fast = _engine(path, spec, dev)
    if name in FP8_COPIES:
        from hylo.ops.fp8 import Fp8Weight

        assert sum(isinstance(m, Fp8Weight) for m in fast.model.modules()) >= 8
    logits = fast.prompt_logits(prompts[0]).cpu()
    out = _generate(fast, prompts, 10)
    monkeypatch.setenv("HYLO_DISABLE_TRITON", "1")  # from here on every op runs its torch reference
    ref = _engine(path, None, dev)
    ref_logits = ref.prompt_logits(prompts[0]).cpu()
    gap = (logits - ref_logits).abs().max().item()
    # on a GPU the prefill's float32 dots may use TF32 (fla's chunked kernel): about 1e-3 relative per matmul; in
    # the interpreter the two paths agree to float32 rounding
    assert (logits - ref_logits).norm() / ref_logits.norm() < (2e-2 if dev.type == "cuda" else 1e-4), gap
    checked = 0
    margin = max(1e-3, 4 * gap)
    for p, o in zip(prompts, out):
        # the reference's logits along the fast path's own continuation: each fast token must be the reference's
        # argmax there wherever the reference's top two are further apart than the paths' own difference
        full = ref.prompt_logits(p + o[:-1])[len(p) - 1:].cpu()
        top2 = full.topk(2, -1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) > margin
        assert torch.equal(top2.indices[:, 0][clear], torch.tensor(o)[clear]), o
        checked += int(clear.sum())
    assert checked >= 0.5 * 3 * 10, checked  # not vacuous


def test_long_mamba2_prefill_cut_into_segments_matches_the_reference(dev, nemotron_h, monkeypatch):
    """A prompt long enough for the Mamba2 scan to cut its rows into segments (``ops/mamba2_scan_triton.py``), over
    two prefill chunks (the second continues the slots' states): the prompt's logits agree with the reference ops,
    and the cut did happen."""
    from hylo.ops import mamba2_scan_triton

    path = nemotron_h[0]
    plans = []
    build = mamba2_scan_triton.ScanPlan.build.__func__

    def spy(cls, *args, **kwargs):
        plans.append(build(cls, *args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(mamba2_scan_triton.ScanPlan, "build", classmethod(spy))
    prompt = random_prompts(vocab_of(path), [700], seed=4)[0]

    def engine():
        return Engine(path, device=dev, dtype="float32",
                      engine_config=EngineConfig(verbose=False, max_num_seqs=1, cuda_graph_sizes=(1,),
                                                 chunk_size=512, max_model_len=1024))

    logits = engine().prompt_logits(prompt).cpu()
    assert len(plans) == 2 and plans[0].num_inner >= 1, [(p.num_segments, p.num_inner) for p in plans]
    # against the same kernels with every row whole: equal up to the order of the float32 sums (a segment's start
    # state folded wrong moves the logits by about 2e-3 of their norm)
    monkeypatch.setattr(mamba2_scan_triton, "SEGMENTS", False)
    whole = engine().prompt_logits(prompt).cpu()
    assert plans[-1].num_inner == 0
    assert (logits - whole).norm() / whole.norm() < 1e-4, (logits - whole).abs().max().item()
    monkeypatch.setenv("HYLO_DISABLE_TRITON", "1")
    ref_logits = engine().prompt_logits(prompt).cpu()
    tol = 2e-2 if dev.type == "cuda" else 1e-4
    assert (logits - ref_logits).norm() / ref_logits.norm() < tol, (logits - ref_logits).abs().max().item()
