"""Bad input gets a clear error naming the problem, and the requests already running carry on unharmed."""

import math
import subprocess
import sys

import pytest

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.layers.weights import CheckpointError

from helpers import random_prompts, vocab_of

BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["a"] * 33), "stop takes at most 32"),
    (dict(stop="x" * 1025), "stop takes at most"),
]


@pytest.mark.parametrize("kwargs", [dict(overlap="no"), dict(verbose="yes"), dict(cuda_graphs=1),
                                    dict(enable_prefix_caching=None)])
def test_engine_switches_must_be_booleans(kwargs):
    from hylo.config import EngineConfig

    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be True or False"):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs,word", [(dict(speculative="ngram", simulate_accept_length="2"), "a number"),
                                         (dict(cuda_graph_sizes="abc"), "batch sizes"),
                                         (dict(cuda_graph_sizes=[1, 0]), "batch sizes")])
def test_engine_numbers_of_the_wrong_type_are_named(kwargs, word):
    from hylo.config import EngineConfig

    with pytest.raises(ValueError, match=f"{next(iter(kwargs.keys() - {'speculative'}))} must be {word}"):
        EngineConfig(**kwargs)


def test_graph_sizes_that_no_batch_can_use_are_refused():
    """Every captured size past max_num_seqs: no batch could replay a graph (the capture crashed on none left)."""
    from hylo.config import EngineConfig

    with pytest.raises(ValueError, match="no size within max_num_seqs=8"):
        EngineConfig(cuda_graph_sizes=(16, 32), max_num_seqs=8)
    assert EngineConfig(cuda_graph_sizes=(4, 16), max_num_seqs=8).cuda_graph_sizes == (4, 16)


@pytest.mark.parametrize("kwargs,word", BAD_PARAMS)
def test_bad_sampling_params(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_bad_requests_never_harm_running_ones(ckpt_a):
    vocab = vocab_of(ckpt_a)
    prompts = random_prompts(vocab, [9, 14], seed=20)
    params = SamplingParams(max_tokens=8, temperature=0)
    ref = LLM(ckpt_a, verbose=False).generate(prompts, params, use_tqdm=False)

    eng = Engine(ckpt_a, engine_config=EngineConfig(verbose=False, max_model_len=64))
    rids = [eng.add_request(p, params) for p in prompts]
    eng.step()
    cases = [
        ([], "empty"),
        ("", "empty"),
        ([1, vocab, 2], f"token id {vocab} at position 1 is out of vocabulary"),
        ([-1], "out of vocabulary"),
        ([1, 2.5], "not an integer"),
        ([1] * 64, "context limit"),
        ("some text", "no tokenizer"),
        (42, "must be a string or a list of token ids"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            eng.add_request(prompt, params)
        eng.step()
    bad = SamplingParams(max_tokens=4)
    bad.temperature = -1.0  # mutated after construction: still caught at submission
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request(prompts[0], bad)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(prompts[0], params, request_id=rids[0])
    while eng.has_unfinished():
        eng.step()
    assert [eng.pop_finished(r).token_ids for r in rids] == [o.token_ids for o in ref]


def test_generate_names_the_bad_prompt_and_stays_usable(ckpt_a):
    llm = LLM(ckpt_a, verbose=False)
    good = random_prompts(vocab_of(ckpt_a), [5], seed=21)[0]
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate([good, []], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([good], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids) == 3


def test_token_ids_as_arrays_are_prompts(ckpt_a):
    """Token ids as a numpy array or torch tensor (one prompt, or rows of prompts), or a list of numpy integers,
    give the same tokens as a plain list; a float array is refused by position."""
    import numpy as np
    import torch
    llm = LLM(ckpt_a, verbose=False)
    a, b = random_prompts(vocab_of(ckpt_a), [6, 6], seed=23)
    p = SamplingParams(max_tokens=3, temperature=0)
    want = [o.token_ids for o in llm.generate([a, b], p, use_tqdm=False)]
    for single in (np.array(a), torch.tensor(a), [np.int64(t) for t in a], np.array(a, dtype=np.int32)):
        got = llm.generate(single, p, use_tqdm=False)
        assert len(got) == 1 and got[0].token_ids == want[0] and got[0].prompt_token_ids == a
        assert all(type(t) is int for t in got[0].prompt_token_ids)
    for rows in (np.array([a, b]), torch.tensor([a, b]), [np.array(a), np.array(b)]):
        assert [o.token_ids for o in llm.generate(rows, p, use_tqdm=False)] == want
    with pytest.raises(ValueError, match="position 0 is 1.5"):
        llm.generate(np.array([1.5, 2.0]), p)
    with pytest.raises(ValueError, match="not an integer token id"):
        llm.generate(np.array([True, False]), p)


def test_bad_engine_options_and_checkpoints(tmp_path, ckpt_a):
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(ckpt_a, max_num_seq=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(ckpt_a, max_num_seqs=0)
    with pytest.raises(ValueError, match="seed must be an integer"):
        LLM(ckpt_a, seed=1.5)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="is a file: give the checkpoint's directory"):
        LLM(str(tmp_path / "config.json"))
    # a checkpoint with a missing and one with a wrongly shaped tensor
    import shutil

    from safetensors.torch import load_file, save_file
    for mutate, message in [(lambda t: t.pop("model.layers.2.linear_attn.A_log"), "missing tensor"),
                            (lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"][:-1]),
                             "has shape")]:
        bad = tmp_path / f"bad_{message.split()[0]}"
        shutil.copytree(ckpt_a, bad)
        tensors = load_file(str(bad / "model.safetensors"))
        mutate(tensors)
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            LLM(str(bad), verbose=False)


def test_cli_generate_and_cli_errors():
    run = [sys.executable, "-m", "hylo", "generate"]
    ok = subprocess.run(run + ["Hello", "--max-tokens", "8"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() and not ok.stdout.startswith("Hello")  # piped: the completion alone, no prompt
    assert "8 tokens" in ok.stderr and "tokens/s" in ok.stderr and "embedded default" in ok.stderr
    bad = subprocess.run(run + ["Hello", "--temperature", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "temperature" in bad.stderr
    empty = subprocess.run(run + ["--prompt", ""], capture_output=True, text=True, timeout=120)
    assert empty.returncode == 2 and "empty" in empty.stderr
    spec = subprocess.run(run + ["ab ab ab ab", "--max-tokens", "12", "--speculative", "mtp",
                                 "--num-speculative-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert spec.returncode == 0, spec.stderr
    assert "speculative (mtp, k=2)" in spec.stderr
    # (the adaptive policy may keep this random-weight model's steps plain: then no mean is printed)
    assert "mean accept length" in spec.stderr or "0 verify steps" in spec.stderr and "no verify step ran" in spec.stderr
    bad_k = subprocess.run(run + ["x", "--speculative", "ngram", "--num-speculative-tokens", "0"],
                           capture_output=True, text=True, timeout=120)
    assert bad_k.returncode == 2 and "num_speculative_tokens" in bad_k.stderr
    for flag, value in (("--num-speculative-tokens", "5"), ("--spec-policy", "fixed"), ("--spec-commit", "replay")):
        alone = subprocess.run(run + ["x", flag, value], capture_output=True, text=True, timeout=120)
        assert alone.returncode == 2 and f"{flag} tunes speculative decoding" in alone.stderr, alone.stderr
    off = subprocess.run(run + ["x", "--no-prefix-caching", "--prefix-snapshots", "4"], capture_output=True, text=True,
                         timeout=120)
    assert off.returncode == 2 and "--prefix-snapshots tunes the prefix cache" in off.stderr, off.stderr


def test_a_malformed_tuning_variable_is_one_cli_line():
    """A HYLO_* setting read when the kernels' modules load: the CLI names it in one line (it was a traceback
    before the CLI's error handler ran, from importing the package)."""
    import os

    env = {**os.environ, "HYLO_PDL": "abc"}
    bad = subprocess.run([sys.executable, "-m", "hylo", "generate", "x", "--max-tokens", "2"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "HYLO_PDL='abc'" in bad.stderr and "Traceback" not in bad.stderr
    # a documented value at its edge is read, not refused: 0 keeps the W8A16 matmul for every row count
    zero = subprocess.run([sys.executable, "-c", "import hylo.ops.linear as m; print(m.FP8_DEQUANT_ROWS)"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HYLO_FP8_DEQUANT_ROWS": "0"})
    assert zero.returncode == 0 and zero.stdout.strip() == "0", zero.stderr


def test_a_refused_or_interrupted_generate_leaves_nothing_queued(monkeypatch):
    """Every prompt of a generate call is checked before any is queued (a constraint that does not compile names
    its prompt); a call interrupted mid-run ends its requests and drops them from the engine's table; the next
    call runs as if alone. Sample i of a seeded request with n > 1 has seed + i wrapped into 64 bits, and unseeded
    samples draw their base from the engine's seed."""
    from hylo.constrain.spec import Constraint

    llm = LLM(None, device="cpu", verbose=False, max_num_seqs=4, seed=5)
    eng = llm.engine
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them.*got dict"):
        llm.generate("a", {"max_tokens": 3})
    greedy = SamplingParams(max_tokens=6, temperature=0)
    alone = llm.generate(["def f(x):"], greedy, use_tqdm=False)[0].token_ids
    bad = SamplingParams(max_tokens=6, constraint=Constraint.regex("[0-9"))
    with pytest.raises(ValueError, match=r"^prompt 1: regex constraint"):
        llm.generate(["def f(x):", "x"], [greedy, bad], use_tqdm=False)
    assert not eng.has_unfinished() and not eng._reqs
    real_step, calls = eng.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(eng, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["def f(x):"] * 3, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    monkeypatch.setattr(eng, "step", real_step)
    while eng.has_unfinished():
        eng.step()
    assert not eng._reqs
    assert llm.generate(["def f(x):"], greedy, use_tqdm=False)[0].token_ids == alone
    top = SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=(1 << 63) - 1)
    assert len(llm.generate(["x"], top, use_tqdm=False)[0].outputs) == 2
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, n=2)
    again = LLM(None, device="cpu", verbose=False, max_num_seqs=4, seed=5)
    for a in (llm, again):  # the same draws from the engine's generator, in the same order
        a.engine._rng.seed(5)
    outs = [[o.token_ids for o in a.generate(["x"], unseeded, use_tqdm=False)[0].outputs] for a in (llm, again)]
    assert outs[0] == outs[1]


def test_a_simulated_accept_length_on_real_weights_is_said(capfd):
    """simulate_accept_length is a benchmark's knob: on a trained model it changes the outputs, and says so."""
    LLM(None, device="cpu", verbose=False, speculative="mtp", num_speculative_tokens=2, simulate_accept_length=2.0)
    assert "simulate_accept_length=2.0" in capfd.readouterr().err
    LLM("hylo-default-random", device="cpu", verbose=False, speculative="mtp", num_speculative_tokens=2,
        simulate_accept_length=2.0)
    assert "simulate_accept_length" not in capfd.readouterr().err


def test_stream_gives_generates_output_as_it_grows():
    """LLM.stream: each yielded text is a prefix of the final one (a tail that may become a stop string is held
    back), the last one finished and equal to generate's; leaving the loop early ends the request; n > 1 is
    refused."""
    llm = LLM(None, device="cpu", verbose=False, max_num_seqs=4)
    for params in (SamplingParams(max_tokens=24, temperature=0),
                   SamplingParams(max_tokens=40, temperature=0, stop=["0x11 |x)"])):
        whole = llm.generate(["def f(x):"], params, use_tqdm=False)[0]
        outs = list(llm.stream("def f(x):", params))
        assert outs[-1].finished and outs[-1].text == whole.text and outs[-1].token_ids == whole.token_ids
        assert len(outs) > 2 and all(not o.finished and whole.text.startswith(o.text) for o in outs[:-1])
        assert outs[-1].finish_reason == whole.finish_reason
        assert params.stop is None or whole.finish_reason == "stop"  # (the stop string is in this output)
    for out in llm.stream("def f(x):", SamplingParams(max_tokens=30, temperature=0)):
        break
    assert not llm.engine._reqs and not llm.engine.scheduler.num_unfinished
    with pytest.raises(ValueError, match="n=2 needs generate"):
        next(llm.stream("x", SamplingParams(n=2)))
    assert llm.generate(["def f(x):"], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].text \
        == list(llm.stream("def f(x):", SamplingParams(max_tokens=24, temperature=0)))[-1].text


def test_streams_and_generate_interleave_without_holding_the_engine():
    """A paused stream holds nothing: generate inside a stream's loop (same thread), two streams zipped, and a
    generate from another thread all run, with the outputs each gives alone; leaving a stream ends its request."""
    import threading

    llm = LLM(None, device="cpu", verbose=False, max_num_seqs=4)
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = {t: llm.generate(t, p, use_tqdm=False)[0].token_ids for t in ("def f(", "import ", "class A")}
    got = []
    for i, out in enumerate(llm.stream("def f(", p)):
        if i == 2:
            got.append(llm.generate("import ", p, use_tqdm=False)[0].token_ids)
    assert out.finished and out.token_ids == alone["def f("] and got == [alone["import "]]
    pairs = list(zip(llm.stream("def f(", p), llm.stream("class A", p)))
    assert pairs[-1][0].token_ids[:len(pairs)] == alone["def f("][:len(pairs)]
    paused = llm.stream("import ", p)
    next(paused)
    box = []
    worker = threading.Thread(target=lambda: box.append(llm.generate("class A", p, use_tqdm=False)[0].token_ids))
    worker.start()
    worker.join(60)
    assert box == [alone["class A"]]
    assert list(paused)[-1].token_ids == alone["import "]
    assert not llm.engine._reqs and llm.engine.caches.req_slots.num_used == 0


def test_close_waits_for_a_running_call_and_a_paused_stream_says_closed():
    import threading
    import time

    llm = LLM(None, device="cpu", verbose=False)
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    paused = llm.stream("def f(", p)
    next(paused)
    box = []
    worker = threading.Thread(target=lambda: box.append(llm.generate(["import "] * 3, p, use_tqdm=False)))
    worker.start()
    time.sleep(0.2)
    llm.close()  # waits for the generate running in the other thread
    worker.join(60)
    assert len(box) == 1 and all(len(o.token_ids) == 40 for o in box[0])
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        next(paused)
