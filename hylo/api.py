"""The offline entry point: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import numbers
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .core import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams, wrap_int64
from .launch import create_engine
from .engine.detok import settled_length
from .engine.intake import check_room, is_id_vector


class LLM:
    """An engine for offline generation.

    ``model`` is a Hugging Face checkpoint directory of a supported family (or a Hub id), or None for the embedded
    default (a small trained Qwen3-Next model; ``"hylo-default-random"`` is its random-weight twin). ``engine_options`` are the fields of :class:`hylo.config.EngineConfig`, speculative
    decoding included: ``speculative="mtp" | "ngram"``, ``num_speculative_tokens=3``; and
    ``tensor_parallel_size=N`` (N processes, one GPU each on CUDA; gloo on CPU).
    """

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str = "auto", **engine_options):
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint directory or a Hugging Face Hub id (a string), or None for "
                            f"the embedded default; got {type(model).__name__}")
        self._lock = threading.Lock()  # one generate() at a time: the engine's steps are not thread-safe
        unknown = set(engine_options) - EngineConfig.option_names()
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(sorted(EngineConfig.option_names()))}")
        ec = EngineConfig(**engine_options)
        self.engine = create_engine(os.fspath(model) if model is not None else None, device, dtype, ec)

    def close(self) -> None:
        """Give the engine's memory back now (its CUDA graphs, caches and weights) and stop the tensor-parallel
        follower processes, if any. Also done when the LLM is dropped (``del llm``) or its ``with`` block ends. A
        call running in another thread finishes first; a paused ``stream`` raises on its next step."""
        with self._lock:
            engine = self.__dict__.pop("engine", None)
            if engine is not None:
                engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the modules it needs may be gone
            pass

    def _engine(self):
        engine = self.__dict__.get("engine")
        if engine is None:
            raise RuntimeError("this LLM was closed: its engine's memory was given back; make a new LLM")
        return engine

    @property
    def tokenizer(self):
        return self._engine().tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order.

        Every prompt and parameter set is validated before anything runs: a bad one raises ValueError naming its
        index and the problem. Calls from several threads run one after another.
        """
        with self._lock:
            return self._generate(self._engine(), prompts, sampling_params, use_tqdm)

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Generate for one prompt (one sample), yielding its output as it grows: a RequestOutput after each step
        that added to it, whose ``text`` is what is settled (a tail that may still become a stop string is held
        back), the last one finished. Checked as ``generate`` checks; leaving the loop early ends the request.

        The engine is held only while it steps, not while the caller has an output: other streams and
        ``generate`` calls (this thread's or another's) run meanwhile, and their steps advance this request too."""
        p = sampling_params or SamplingParams()
        with self._lock:
            engine = self._engine()
            _check(engine, prompt, p)
            if p.n != 1:
                raise ValueError(f"stream gives one sample; n={p.n} needs generate")
            rid = engine.add_request(prompt, p)
        seen = 0  # output tokens already yielded
        try:
            while True:
                with self._lock:
                    engine = self._engine()
                    req = engine.request(rid)
                    if not req.finished and len(req.output_ids) == seen:
                        engine.step()
                        if not req.finished and not engine.has_unfinished():
                            raise RuntimeError("engine stopped with the request pending (this is a bug)")
                    if req.finished:
                        if engine.scheduler.num_unfinished == 0:
                            engine.drain()  # its launched step, read: the slots are free again
                        out = engine.pop_finished(rid)
                    elif len(req.output_ids) > seen:
                        seen = len(req.output_ids)
                        out = engine.output_of(req)
                        if out.text is not None:  # what may still become a stop string waits
                            out.text = out.text[:settled_length(req)]
                    else:
                        continue
                if out.finished:
                    if out.error:
                        raise _error(out.error, out.error_status)
                    yield out
                    return
                yield out
        finally:
            with self._lock:
                engine = self.__dict__.get("engine")
                if engine is not None:
                    _discard(engine, [rid])

    def _generate(self, eng, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if prompts is None or isinstance(prompts, (dict, bytes, int)) or not isinstance(prompts, Iterable):
            raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got "
                             f"{type(prompts).__name__}")
        if isinstance(prompts, str) or is_id_vector(prompts) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        if isinstance(sampling_params, (dict, str, bytes)) or not (
                sampling_params is None or isinstance(sampling_params, (SamplingParams, Iterable))):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                             f"{type(sampling_params).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                _check(eng, prompt, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        # n samples of a prompt are n requests, sample i seeded with seed + i, wrapped into 64 bits (the base drawn
        # once from the engine's generator when the seed is None)
        groups, rids = [], []
        try:
            for prompt, p in zip(prompts, params):
                base = p.seed if p.seed is not None else eng.draw_seed()
                choices = [p] if p.n == 1 else [dataclasses.replace(p, n=1, seed=wrap_int64(base + i))
                                                for i in range(p.n)]
                groups.append([])
                for c in choices:
                    groups[-1].append(eng.add_request(prompt, c))
                    rids.append(groups[-1][-1])
        except BaseException:
            _discard(eng, rids)  # nothing of a refused call stays queued
            raise
        pending = set(rids)
        # a live bar on a terminal only: on a log its carriage-return updates would run into the lines
        bar = tqdm(total=len(rids), desc="generating", unit="req",
                   disable=not use_tqdm or len(rids) < 2 or not sys.stderr.isatty())
        try:
            while pending:
                for req in eng.step():
                    if req.finished and req.rid in pending:
                        pending.discard(req.rid)
                        bar.update(1)
                if pending and not eng.has_unfinished():
                    raise RuntimeError("engine stopped with requests pending (this is a bug)")
        except BaseException:  # (an interrupt too): the call's requests end and leave the engine's table
            _discard(eng, rids)
            raise
        finally:
            bar.close()
        if eng.scheduler.num_unfinished == 0:
            eng.drain()  # a failed request's launched step: read it, so that its slots are free again
        outputs = []
        for i, group in enumerate(groups):
            done = [eng.pop_finished(rid) for rid in group]
            first = done[0]
            if len(done) > 1:
                first.outputs = [CompletionOutput(j, o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs)
                                 for j, o in enumerate(done)]
            bad = next((o for o in done if o.error), None)
            first.error, first.error_status = (bad.error, bad.error_status) if bad is not None else (None, 500)
            outputs.append(first)
        failed = [o for o in outputs if o.error]
        if failed:  # an internal error is logged with its traceback by the engine; the request's own is a ValueError
            message = "generation failed: " + "; ".join(f"prompt {i}: {o.error}" for i, o in enumerate(outputs)
                                                         if o.error)
            raise _error(message, max(o.error_status for o in failed))
        return outputs


def _error(message: str, status: int) -> Exception:
    """A failed request's error for the caller: RuntimeError for the engine's fault (500; its traceback is in the
    log), ValueError for the request's own (400)."""
    return (RuntimeError if status >= 500 else ValueError)(message)


def _discard(eng, rids) -> None:
    """End the requests ``rids`` (those still running) and drop them from the engine's table."""
    for rid in rids:
        eng.discard(rid)


def _check(eng, prompt, p) -> None:
    """Everything about one prompt and its parameters that can be refused, before anything is queued."""
    if not isinstance(p, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(p).__name__}")
    p.validate()
    check_room(eng.max_model_len, len(eng.encode_prompt(prompt)), p.max_tokens)
    eng.check_token_ids(p)
    if p.constraint is not None:
        eng.compile_constraint(p.constraint)  # (cached: add_request finds it compiled)
