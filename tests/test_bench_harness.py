"""The benchmark's harness on CPU: fake-prefilled requests decode like real ones, and the floors add up."""

import pytest
import torch

from hylo.bench.floors import Footprint
from hylo.bench.shapes import bench_config
from hylo.bench.steps import fake_prefill, prefill_times, time_steps
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.speculative.setup import SpecSetup


def fake_caches(conv: tuple, recurrent: tuple, kv: tuple):
    """What ``Footprint.of`` reads of the caches, as meta tensors (shapes only): the state pool's conv and recurrent
    tensors and the KV pool's keys, each [layers, slots, ...]."""
    from types import SimpleNamespace

    meta = dict(device="meta")
    return SimpleNamespace(
        state_pool=SimpleNamespace(conv=torch.empty(conv, dtype=torch.bfloat16, **meta),
                                   recurrent=torch.empty(recurrent, dtype=torch.float32, **meta)),
        kv_pool=SimpleNamespace(k=torch.empty(kv, dtype=torch.bfloat16, **meta)))


def test_fake_prefill_decodes_and_frees():
    eng = Engine(None, device="cpu", engine_config=EngineConfig(enable_prefix_caching=False, verbose=False, max_num_seqs=4))
    rids = fake_prefill(eng, 3, 40)
    ms = time_steps(eng, 2, warmup=1)
    assert ms > 0
    for rid in rids:
        req = eng._reqs[rid]
        assert req.num_computed == 40 + 2 and len(req.output_ids) == 4
        eng.abort(rid)
    c = eng.caches
    assert c.kv_pool.num_free == c.kv_pool.num_tokens and c.req_slots.num_free == 4


def test_prefill_times_runs_each_prefill_and_frees_it():
    """The bench's prefill row (and ``ab_decode --prefill``): each run prefills a fresh request in one step, is
    timed, and leaves the engine's pools as they were."""
    eng = Engine(None, device="cpu", engine_config=EngineConfig(enable_prefix_caching=False, verbose=False, max_num_seqs=2))
    c = eng.caches
    free = (c.kv_pool.num_free, c.req_slots.num_free)
    times = prefill_times(eng, list(range(1, 30)), 3)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert (c.kv_pool.num_free, c.req_slots.num_free) == free and not eng._reqs


def test_fake_prefill_of_sampling_rows():
    """The bench's sampled decode rows: fake-prefilled requests that sample, seeded, and decode like greedy ones."""
    eng = Engine(None, device="cpu", engine_config=EngineConfig(enable_prefix_caching=False, verbose=False, max_num_seqs=4))
    rids = fake_prefill(eng, 2, 40, temperature=0.8)
    time_steps(eng, 3, warmup=1)
    reqs = [eng._reqs[r] for r in rids]
    assert all(r.params.temperature == 0.8 and r.params.seed is not None for r in reqs)
    assert all(len(r.output_ids) == 5 for r in reqs)
    for rid in rids:
        eng.abort(rid)


def _simulated_mean_accept(rows: int, target: float, steps: int, built_with: float | None = None) -> float:
    """Mean tokens per verify step of ``rows`` fake-prefilled MTP requests (k = 3) with simulated acceptance
    (the engine built with ``built_with``, then set to ``target``, as the benchmark does between records)."""
    # every step verifies (the adaptive policy would choose by the steps' measured times, which a busy machine
    # changes: fewer verify steps, fewer draws, a mean further from the target)
    ec = EngineConfig(enable_prefix_caching=False, verbose=False, max_num_seqs=rows, speculative="mtp",
                      num_speculative_tokens=3, simulate_accept_length=built_with or target, spec_policy="fixed")
    eng = Engine(None, device="cpu", engine_config=ec, spec_setup=SpecSetup("mtp"))
    eng.worker.simulate_accept_length = target
    rids = fake_prefill(eng, rows, 30)
    time_steps(eng, steps, warmup=0)
    stats = [eng._reqs[r].spec for r in rids]
    return sum(s.emitted_tokens for s in stats) / sum(s.verify_steps for s in stats)


def test_fake_prefill_with_simulated_speculation():
    assert abs(_simulated_mean_accept(2, 3.0, 20) - 3.0) < 0.3


def test_simulated_fractional_accept_length_through_the_fused_step():
    """A fractional target (2.5 with k = 3: 1 or 2 drafts accepted, half each) through the fused greedy MTP step,
    whose draw is keyed by (request slot, length) so that it can be captured: the mean lands on the target."""
    mean = _simulated_mean_accept(4, 2.5, 30)
    assert abs(mean - 2.5) < 0.15, mean  # 120 draws of one half: standard error 0.046


def test_bench_6b_footprint_matches_the_issue():
    """bench-6b: 6.3 B parameters, about 3.8 GB read per token at batch 1 (the issue's figures)."""
    from hylo.models.qwen3_next import Qwen3NextForCausalLM

    mc = bench_config("bench-6b")
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(mc, torch.bfloat16, "meta")
    params = sum(p.numel() for p in model.parameters())
    assert 6.2e9 < params < 6.4e9

    FakeCaches = fake_caches(conv=(18, 2, 8192, 3), recurrent=(18, 2, 32, 128, 128),
                             kv=(6, 2, 2, 256))

    fp = Footprint.of(model, None, FakeCaches)
    per_token = fp.decode_bytes(1, 1) - 2 * fp.state_per_req - fp.kv_per_token
    assert 3.6e9 < per_token < 4.0e9
    assert 36e6 < fp.state_per_req < 40e6  # about 38 MB of float32 GDN state per request


def test_hf_comparison_uses_the_same_weights():
    """The bench's HF side: hylo loaded from an HF model's in-memory weights computes the same logits."""
    from hylo.bench.run import build_model
    from hylo.bench.hf import build_hf
    from hylo.models.default import default_model_config

    mc = default_model_config()
    torch.manual_seed(0)
    hf = build_hf(mc, torch.device("cpu")).float()
    lm = build_model(mc, torch.device("cpu"), hf_model=hf)
    lm.model.float()
    eng = Engine(lm, device="cpu", dtype="float32", engine_config=EngineConfig(enable_prefix_caching=False, verbose=False))
    prompt = [5, 77, 200, 3, 9, 41]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert torch.allclose(eng.prompt_logits(prompt), ref, atol=1e-4)


def test_the_bench_lets_the_hf_model_go_after_its_rows():
    """Once its rows are measured, the bench's model no longer reads through the HF model's state dict (on an 80 GB
    GPU that second copy of the weights ran the bench out of memory), and the MTP head, which HF drops, still loads
    from the reader that is left."""
    from hylo import SamplingParams
    from hylo.bench.run import build_model, forget_hf_model
    from hylo.bench.hf import HFReader, build_hf
    from hylo.models.default import default_model_config

    mc = default_model_config()
    hf = build_hf(mc, torch.device("cpu")).float()
    lm = build_model(mc, torch.device("cpu"), hf_model=hf)
    hf_reader = lm.reader
    assert isinstance(hf_reader, HFReader)
    forget_hf_model(lm)
    assert lm.reader is hf_reader.fallback and not isinstance(lm.reader, HFReader)
    lm.model.float()  # build_model makes bfloat16 weights; the CPU engine here runs in float32
    eng = Engine(lm, device="cpu", dtype="float32", spec_setup=SpecSetup("mtp"),
                 engine_config=EngineConfig(enable_prefix_caching=False, verbose=False, speculative="mtp", num_speculative_tokens=2))
    rid = eng.add_request([5, 77, 200], SamplingParams(max_tokens=3, temperature=0))
    while eng.has_unfinished():
        eng.step()
    assert len(eng.pop_finished(rid).token_ids) == 3


def test_simulated_target_changes_after_the_engine_is_built():
    """The target is read from a device tensor at every step (a captured step would otherwise keep the value it
    was captured with: run -081134 measured 3.0 for targets 2.0 and 4.0); switching simulation off is refused."""
    assert abs(_simulated_mean_accept(2, 2.0, 20, built_with=3.0) - 2.0) < 0.3
    assert abs(_simulated_mean_accept(2, 4.0, 20, built_with=3.0) - 4.0) < 1e-9  # every draft accepted
    ec = EngineConfig(enable_prefix_caching=False, verbose=False, max_num_seqs=1, speculative="mtp", num_speculative_tokens=3,
                      simulate_accept_length=3.0)
    eng = Engine(None, device="cpu", engine_config=ec, spec_setup=SpecSetup("mtp"))
    with pytest.raises(ValueError, match="simulate_accept_length"):
        eng.worker.simulate_accept_length = None


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_record_counts_steps_reads_and_accept_length(overlap):
    """The benchmark's overlap record on the CPU engine: the measured accept length is the simulated one, the
    overlap loop makes no blocking read per step and the plain loop one, and the requests are cleared after."""
    from dataclasses import replace

    from hylo.bench.run import _overlap_record

    ec = EngineConfig(enable_prefix_caching=False, verbose=False, max_num_seqs=2, speculative="mtp", num_speculative_tokens=3,
                      simulate_accept_length=3.0, max_model_len=1100, kv_cache_tokens=2400)
    eng = Engine(None, device="cpu", engine_config=ec, spec_setup=SpecSetup("mtp"))
    eng.ec = replace(eng.ec, overlap=overlap)
    rec = _overlap_record(eng, 2, 3, 6)
    assert rec["overlap"] is overlap and rec["spec"] == "mtp" and rec["ms_per_step"] > 0
    assert abs(rec["accept_length"] - 3.0) < 1e-9
    assert rec["blocking_syncs_per_step"] == (0.0 if overlap else 1.0)
    assert "graph_ms_per_step" not in rec  # no graphs on the CPU: no unprofiled busy figure to report
    # no device intervals on the CPU: all of the window is outside the (empty) span of GPU work
    idle = rec["idle_us_per_step"]
    assert idle["short_gaps"] == idle["long_gaps"] == 0 and idle["outside_span"] > 0 and rec["longest_gaps"] == []
    assert rec["gpu_busy_fraction"] == rec["gpu_busy_fraction_steady"] == 0.0
    assert not eng.has_unfinished() and eng.caches.req_slots.num_free == 2


def test_busy_is_the_union_of_device_intervals_and_lists_the_gaps():
    """The overlap records' arithmetic on a made-up trace: overlapping intervals (PDL) count once, host events are
    ignored, the span runs from the first start to the latest end, and each gap names its neighbours."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from hylo.bench.steps import _busy

    def ev(name, a, b, dev=DeviceType.CUDA):
        return NS(name=name, device_type=dev, time_range=NS(start=a, end=b))

    prof = NS(events=lambda: [ev("k1", 0, 10), ev("k2", 8, 30), ev("host", 30, 90, DeviceType.CPU),
                              ev("k3", 35, 40), ev("k4", 40, 45), ev("k5", 100, 101), ev("k6", 50, 60)])
    busy, span, gaps = _busy(prof)
    assert busy == 30 + 10 + 10 + 1 and span == 101
    assert gaps == [(5, "k2", "k3"), (5, "k4", "k6"), (40, "k6", "k5")]


@pytest.mark.parametrize("name,params,bs1_bytes", [("qwen3.5-9b", (8.8e9, 9.1e9), (15.5e9, 16.5e9)),
                                                   ("qwen3.5-35b-a3b", (34.4e9, 34.9e9), (5.7e9, 6.3e9))])
def test_qwen35_bench_shapes(name, params, bs1_bytes):
    """The Qwen3.5 benchmark shapes are the released text models (Qwen3.5-9B: 8.95 B text parameters, a dense MLP in
    every layer; Qwen3.5-35B-A3B: 34.7 B, 2.4 B multiplied per token), built through the registry."""
    from hylo.models.registry import build_model, build_mtp
    from hylo.parallel.group import SINGLE

    mc = bench_config(name)
    with torch.device("meta"):
        model = build_model(mc, torch.bfloat16, "meta", SINGLE)
        mtp = build_mtp(mc, model, torch.bfloat16, "meta")
    assert type(model).family == "Qwen3.5"
    assert params[0] < sum(p.numel() for p in model.parameters()) < params[1]

    gdn, attn = len(mc.linear_layer_ids), len(mc.attn_layer_ids)
    FakeCaches = fake_caches(conv=(gdn, 2, mc.conv_dim, 3), recurrent=(gdn, 2, 32, 128, 128),
                             kv=(attn, 2, mc.num_key_value_heads, 256))

    fp = Footprint.of(model, mtp, FakeCaches)
    assert bs1_bytes[0] < fp.decode_bytes(1, 1) < bs1_bytes[1]
    # a dense model reads the same weights at any batch size; a MoE model reads more experts as the batch grows
    grows = fp.decode_bytes(64, 1) - 64 * (fp.embed_row + fp.kv_per_token + 2 * fp.state_per_req) \
        - (fp.decode_bytes(1, 1) - fp.embed_row - fp.kv_per_token - 2 * fp.state_per_req)
    assert (grows == 0) == (mc.num_experts == 0), grows


def test_fp8_shapes_read_half_the_weight_bytes():
    """The -fp8 benchmark shapes keep their projections in FP8: an expert is a byte a weight plus its block scales,
    and the 80B shape's weights fit one H200 (about 80 GB)."""
    from hylo.models.qwen3_next import Qwen3NextForCausalLM

    FakeCaches = fake_caches(conv=(36, 2, 8192, 3), recurrent=(36, 2, 32, 128, 128),
                             kv=(12, 2, 2, 256))

    fps = {}
    for name in ("qwen3-next-80b", "qwen3-next-80b-fp8"):
        mc = bench_config(name)
        with torch.device("meta"):
            model = Qwen3NextForCausalLM(mc, torch.bfloat16, "meta")
        fps[name] = (Footprint.of(model, None, FakeCaches), sum(p.numel() * p.element_size()
                                                                for p in model.parameters()))
    (bf, bf_total), (f8, f8_total) = fps["qwen3-next-80b"], fps["qwen3-next-80b-fp8"]
    assert 0.5 < f8.expert / bf.expert < 0.501  # 3 x 512 x 2048 bytes + 3 x 4 x 16 float32 scales
    assert f8.matmul_params == bf.matmul_params and f8.lm_head == bf.lm_head
    assert 0.5 < f8.non_expert / bf.non_expert < 0.6  # norms, routers, GDN a/b rows stay bfloat16
    assert 150e9 < bf_total < 165e9 and 78e9 < f8_total < 84e9


def test_fp8_bench_model_builds_with_fp8_weights_and_computes_their_values():
    """``tiny-fp8`` built as the bench builds it (random weights rounded to FP8 on the device, kept FP8): every
    projection is FP8, and it computes what the same weights dequantized compute."""
    from hylo.bench.run import build_model
    from dataclasses import replace
    from hylo.ops.fp8 import Fp8Weight

    mc = bench_config("tiny-fp8")
    lm = build_model(mc, "cpu", name="tiny-fp8")
    fp8 = [n for n, m in lm.model.named_modules() if isinstance(m, Fp8Weight)]
    layers = mc.num_hidden_layers
    assert len(fp8) >= 4 * layers, fp8  # mixer in / out, w13 / w2 or gate_up / down
    plain = build_model(replace(mc, quantization=replace(mc.quantization, keep=False)), "cpu")
    assert not any(isinstance(m, Fp8Weight) for m in plain.model.modules())
    ec = EngineConfig(verbose=False, enable_prefix_caching=False, max_num_seqs=2)
    a = Engine(lm, device="cpu", engine_config=ec).prompt_logits(list(range(3, 40)))
    b = Engine(plain, device="cpu", engine_config=ec).prompt_logits(list(range(3, 40)))
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_mamba2_bench_shapes():
    """``nemotron-h-8b`` is Nemotron-H-8B's size (8.1 B parameters, dense: the same bytes at every batch size) and
    its footprint counts the Mamba2 state; ``tiny-mamba2`` builds as the bench builds models and decodes through the
    fake-prefilled rows the bench times."""
    from hylo.bench.run import build_model as bench_build
    from hylo.models.registry import build_model
    from hylo.parallel.group import SINGLE

    mc = bench_config("nemotron-h-8b")
    with torch.device("meta"):
        model = build_model(mc, torch.bfloat16, "meta", SINGLE)
    assert type(model).family == "Nemotron-H"
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.2e9
    conv, kernel, heads, p, n = mc.state_dims

    FakeCaches = fake_caches(conv=(24, 2, 10240, kernel - 1), recurrent=(24, 2, heads, p, n),
                             kv=(4, 2, 8, 128))

    fp = Footprint.of(model, None, FakeCaches)
    assert fp.state_per_req == 24 * (10240 * 3 * 2 + 128 * 64 * 128 * 4)
    # 8.1 B bfloat16 weights less the embedding table (a row is read), plus the state read and written
    assert 15.0e9 < fp.decode_bytes(1, 1) < 15.6e9 and fp.moe_layers == 0
    lm = bench_build(bench_config("tiny-mamba2"), "cpu", name="tiny-mamba2")
    assert type(lm.model.layers[4].mixer).__name__ == "GroupedSigmoidMoE"
    eng = Engine(lm, device="cpu", engine_config=EngineConfig(enable_prefix_caching=False, verbose=False,
                                                               max_num_seqs=2))
    rids = fake_prefill(eng, 2, 20)
    assert time_steps(eng, 2, warmup=1) > 0
    assert all(len(eng._reqs[r].output_ids) == 4 for r in rids)
    # the speculative records of a family without an MTP head: n-gram's verify step at a simulated accept length
    ec = EngineConfig(enable_prefix_caching=False, verbose=False, max_num_seqs=2, speculative="ngram",
                      num_speculative_tokens=3, simulate_accept_length=3.0, spec_policy="fixed")
    eng = Engine(lm, device="cpu", engine_config=ec, spec_setup=SpecSetup("ngram"))
    rids = fake_prefill(eng, 2, 20)
    time_steps(eng, 6, warmup=1)
    reqs = [eng._reqs[r] for r in rids]
    assert 2.5 < sum(r.spec.emitted_tokens for r in reqs) / sum(r.spec.verify_steps for r in reqs) < 3.5


def test_nemotron3_bench_shape_and_its_floor():
    """``nemotron-3-nano-30b-a3b`` has the release's 31.6 B parameters; its footprint finds the 23 MoE blocks of
    non-gated experts (an expert is its up and down rows: 2 x 1856 x 2688 bfloat16), so that batch 1 reads 6 of
    128 experts a block and batch 64 nearly all; without an MTP head a speculative step's floor is the verify's."""
    from hylo.models.registry import build_model
    from hylo.parallel.group import SINGLE

    mc = bench_config("nemotron-3-nano-30b-a3b")
    with torch.device("meta"):
        model = build_model(mc, torch.bfloat16, "meta", SINGLE)
    assert 31.5e9 < sum(p.numel() for p in model.parameters()) < 31.7e9

    FakeCaches = fake_caches(conv=(23, 2, 6144, 3), recurrent=(23, 2, 64, 64, 128),
                             kv=(6, 2, 2, 128))

    fp = Footprint.of(model, None, FakeCaches)
    assert fp.moe_layers == 23 and fp.expert == 2 * 1856 * 2688 * 2 and fp.num_experts == 128 and fp.top_k == 6
    assert fp.experts_touched(1) == pytest.approx(6) and 0.9 * 128 < fp.experts_touched(64) < 128
    state = 2 * 63 * fp.state_per_req  # batch 64's 63 more rows read and write their Mamba2 state
    extra_experts = 23 * (fp.experts_touched(64) - 6) * fp.expert
    assert fp.decode_bytes(64, 1) - fp.decode_bytes(1, 1) - state == pytest.approx(extra_experts, rel=0.01)
    verify_only = fp.spec_step_bytes(1, 1024, 3)
    assert verify_only > fp.decode_bytes(1, 1024) and verify_only < fp.decode_bytes(4, 1024) + 8 * fp.state_per_req


def test_structured_bench_runs_half_constrained_batches(tmp_path):
    """``hylo bench --structured`` on the CPU: the schema compiles against the synthetic vocabulary, and each
    batch's constrained half keeps decoding (inside its string fields) through the timed steps."""
    import json as _json

    from hylo.bench.structured import SyntheticTokenizer, run_structured_bench

    tok = SyntheticTokenizer(600)
    assert len({tok.token_bytes(i) for i in range(600)}) == 600 and tok.token_bytes(34) == b'"'
    records = run_structured_bench("tiny", out_dir=str(tmp_path), quick=True, device="cpu")
    assert [(r["batch_size"], r["temperature"]) for r in records] == [(2, 0.0), (2, 0.8)]
    assert all(r["requests_still_running"] == 2 and r["ratio"] > 0 for r in records)
    saved = _json.load(open(next(tmp_path.glob("structured-tiny-*.json"))))
    assert saved["meta"]["states"] > 10 and saved["meta"]["compile_seconds"] > 0


def test_release_spelling_of_the_80b_shape_is_accepted(monkeypatch):
    """``hylo bench --model-name qwen3-next-80b-a3b-fp8`` (the release's spelling) runs the 80B FP8 shape; an unknown
    name is still refused by the parser."""
    from hylo import cli

    assert bench_config("qwen3-next-80b-a3b-fp8") == bench_config("qwen3-next-80b-fp8")
    seen = {}
    monkeypatch.setattr("hylo.bench.run.run_bench", lambda name, **kw: seen.setdefault("name", name))
    assert cli.main(["bench", "--model-name", "qwen3-next-80b-a3b-fp8"]) == 0
    assert seen["name"] == "qwen3-next-80b-fp8"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--model-name", "qwen3-next-80b-a3b-int4"])


def test_bench_modes_on_the_cpu_take_only_tiny_shapes(capsys):
    """``hylo bench --structured / --prefix-replay / --spec-policy`` on a CPU machine with a released shape: one
    error line naming the fix (they used to build bench-6b in float32, tens of GB, before any output)."""
    import torch

    from hylo.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs them")
    for mode in ("--structured", "--prefix-replay", "--spec-policy"):
        assert main(["bench", mode]) == 2
        err = capsys.readouterr().err
        assert "benchmarking bench-6b needs a CUDA GPU" in err and "--model-name tiny" in err
