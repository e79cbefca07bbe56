"""The engine: loads a model, owns the scheduler and the worker, and advances all requests one step at a time.

``add_request`` validates input before anything is queued, so a bad request raises a ValueError naming the problem
and never reaches (or harms) the requests already running.
"""

from __future__ import annotations

import gc
import itertools
import sys
import random
import time
import traceback
from dataclasses import dataclass

import torch

from ..cache.memory import allocate_caches
from ..cache.prefix_cache import PrefixCache
from ..constrain.automaton import AutomatonCache
from ..constrain.host import grammars_given_up, write_host_masks
from ..config import EngineConfig
from ..core import ForwardMode, Req, RequestOutput, SpecStats
from ..parallel.group import SINGLE, TPGroup
from ..ops.triton_utils import use_triton
from ..sampling_params import SamplingParams
from .graphs import default_capture_sizes
from .intake import check_token_ids, encode_prompt
from .host_reads import HostReads, PendingRead, StepTimer
from .loading import LoadedModel, load_model, print_load_notes, print_model_line, resolve_device, resolve_dtype
from .plan import ScheduledBatch
from .scheduler import Scheduler
from .outputs import append_token, apply_prompt_logprobs, unpack_logprobs
from .worker import ModelWorker


@dataclass
class _Launched:
    plan: ScheduledBatch
    read: PendingRead
    prompt_read: PendingRead | None = None
    timer: StepTimer | None = None  # the device time of a speculative engine's decoding step (its policy's costs)
    rows_read: int = 0  # rows whose results were applied (``_read`` ends the rest if the reading is cut)


class Engine:
    """One model, its caches, a scheduler and a worker. Not thread-safe: one caller drives ``step``."""

    def __init__(self, model: "str | LoadedModel | None" = None, device: str = "auto", dtype: str = "auto",
                 engine_config: EngineConfig | None = None, spec_setup=None, tp: TPGroup = SINGLE):
        """``spec_setup`` (from ``hylo.speculative``) adds speculative decoding: ``prepare(loaded_model, dtype,
        device)`` loads what the drafter needs and returns how many extra KV layers it wants; ``wrap(worker,
        config)`` returns the speculative worker."""
        self.ec = engine_config or EngineConfig()
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        t0 = time.perf_counter()
        lm = (model if isinstance(model, LoadedModel)
              else load_model(model, self.dtype, self.device, progress=self.ec.verbose and tp.rank == 0, tp=tp,
                               mtp=getattr(spec_setup, "method", None) == "mtp"))
        self.model_name, self.model_config, self.model = lm.name, lm.config, lm.model
        self.tokenizer, self.is_random = lm.tokenizer, lm.is_random
        self.reader = lm.reader
        # tensor parallelism: the ranks must choose the same steps; the leader alone times them and hands its step
        # costs over before each step (set_step_costs), the others never measure
        self.times_steps = tp.rank == 0
        extra_kv = spec_setup.prepare(lm, self.dtype, self.device) if spec_setup is not None else 0
        if self.ec.verbose and tp.rank == 0:
            print_load_notes(lm, self.dtype)  # (after the drafter's prepare: it reads the mtp.* tensors)
        self.caches = allocate_caches(lm.shard_config, self.ec, self.dtype, self.device, extra_kv)
        self.max_model_len = self.caches.max_model_len
        k = self.ec.spec_tokens
        # the MTP head's KV at a snapshot's position was computed with the token after it: such a hit must agree there
        self.prefix_cache = (PrefixCache(self.caches.kv_pool, self.caches.state_pool, self.caches.snapshot_slots,
                                         match_next_token=self.ec.speculative == "mtp",
                                         decoded_states=self.model_config.decode_matches_prefill)
                             if self.ec.enable_prefix_caching and self.caches.snapshot_slots else None)
        self.scheduler = Scheduler(self.caches, self.ec, k, self.prefix_cache,
                                   decode_matches_prefill=self.model_config.decode_matches_prefill)
        self.eos_ids = set(self.model_config.eos_token_ids)
        self.model_worker = ModelWorker(self.model, self.caches, self.device, extra_kv,
                                        vocab_size=self.model_config.vocab_size, eos_ids=self.eos_ids)
        # the worker interface: run(ScheduledBatch) -> StepResult; a speculative worker wraps the plain one
        self.worker = (spec_setup.wrap(self.model_worker, self.ec) if spec_setup is not None else self.model_worker)
        if self.device.type == "cuda" and self.ec.cuda_graphs and use_triton(self.caches.kv_pool.k):
            sizes = (sorted(s for s in self.ec.cuda_graph_sizes if s <= self.ec.max_num_seqs)
                     if self.ec.cuda_graph_sizes else
                     default_capture_sizes(min(self.ec.max_num_seqs, self.ec.max_graph_batch_size)))
            self.worker.capture_graphs(sizes, self.ec.verbose)
        self._rng = random.Random(self.ec.seed)
        self._ids = itertools.count()
        self._reqs: dict[str, Req] = {}
        self.host_reads = HostReads()
        self._inflight: _Launched | None = None  # the overlap loop's launched, unread step
        self._last_plan: ScheduledBatch | None = None  # the plan of the step the last step() launched
        self._failed: list[Req] = []  # requests failed by an internal error, reported by the next step()
        # compiled constraints, shared by every request (read by the server's metrics)
        self.automata = AutomatonCache(self.tokenizer, self.model_config.vocab_size, eos_ids=self.eos_ids)
        self.host_syncs = 0  # blocking reads for host-matched constraints (constrain.host)
        self.load_seconds = time.perf_counter() - t0
        if self.ec.verbose:
            print_model_line(lm, self.dtype, self.device, self.load_seconds)
            print(f"[hylo] {self.caches.summary()}", file=sys.stderr, flush=True)
        if self.ec.simulate_accept_length is not None and not lm.is_random:  # (a benchmark's knob)
            print(f"[hylo] warning: simulate_accept_length={self.ec.simulate_accept_length} forces how many drafts "
                  "each verify accepts: the outputs are not the model's", file=sys.stderr, flush=True)

    # ---- requests ---------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, validated (``intake.encode_prompt``)."""
        return encode_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                             add_special_tokens)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n != 1:
            raise ValueError(f"n={params.n}: an engine request is one sample (LLM.generate and the server submit n)")
        self.check_token_ids(params)
        ids = self.encode_prompt(prompt)
        automaton = self.compile_constraint(params.constraint) if params.constraint is not None else None
        if automaton is not None and not hasattr(automaton, "walk"):  # a grammar: this request's own host matcher
            automaton = automaton.matcher()
            self.scheduler.host_matching = True
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self.draw_seed()
        req = Req(rid=rid, prompt_ids=ids, params=params, seed=seed,
                  prompt=prompt if isinstance(prompt, str) else None,
                  # prompt log probabilities need every prompt position computed: no cached prefix
                  use_prefix_cache=params.prompt_logprobs is None,
                  spec=SpecStats() if self.ec.speculative else None, prompt_tensor=torch.tensor(ids, dtype=torch.int64),
                  automaton=automaton)
        self._reqs[rid] = req
        self.scheduler.add(req)
        return rid

    def check_token_ids(self, params: SamplingParams) -> None:
        """Token ids the parameters name past the vocabulary: a ValueError starting with the field's name (the
        server and ``LLM`` check before queueing, with this)."""
        check_token_ids(params, self.model_config.vocab_size)

    def draw_seed(self) -> int:
        """A seed for a request that gave none, from the engine's own generator (``EngineConfig.seed``)."""
        return self._rng.getrandbits(63)

    def compile_constraint(self, constraint):
        """A constraint's token automaton (``hylo.constrain``), compiled once per constraint and cached; callable
        from other threads (the server compiles a request's before handing it to the engine thread). Raises
        ValueError naming what cannot be compiled."""
        if self.tokenizer is None:
            raise ValueError("constrained output needs the model's tokenizer, and this model has none")
        if not self.eos_ids:
            raise ValueError("constrained output ends at the model's end-of-sequence token, and this model has none "
                             "(eos_token_id in its config)")
        return self.automata.get(constraint)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its slots; returns False if it is unknown or already finished."""
        req = self._reqs.get(request_id)
        if req is None or req.finished:
            return False
        self.scheduler.finish(req, "abort")
        return True

    def close(self) -> None:
        """Give the engine's device memory back now: its CUDA graphs, caches and model. The graph runner and the
        workers refer to each other (captured closures), so without this their memory would wait for a garbage
        collection. The engine cannot run afterwards."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for worker in (getattr(self, "worker", None), getattr(self, "model_worker", None)):
            if worker is not None and getattr(worker, "graphs", None) is not None:
                worker.graphs = None
        for name in ("worker", "model_worker", "scheduler", "caches", "model", "prefix_cache", "reader",
                     "_inflight", "_last_plan", "_reqs"):
            setattr(self, name, None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (KV and state snapshots go back to the pools). Only on an idle engine: returns
        False, changing nothing, while requests run."""
        if self.has_unfinished():
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return True

    def has_unfinished(self) -> bool:
        """Requests still queued or running, or a launched step not yet read."""
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    def output_of(self, req: Req) -> RequestOutput:
        return RequestOutput(
            request_id=req.rid, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids), text=req.text if self.tokenizer is not None else None,
            finish_reason=req.finish_reason, finished=req.finished, stop_reason=req.stop_reason,
            spec=req.spec, num_preemptions=req.num_preemptions, error=req.error, error_status=req.error_status,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=((list(req.prompt_logprobs) or [None]) if req.params.prompt_logprobs is not None
                             else None))

    def request(self, request_id: str) -> Req | None:
        """The request of this id, while it is in the table (until ``pop_finished`` or ``discard``)."""
        return self._reqs.get(request_id)

    def pop_finished(self, request_id: str) -> RequestOutput:
        req = self._reqs.pop(request_id)
        return self.output_of(req)

    def discard(self, request_id: str) -> None:
        """End the request if it still runs and drop it from the table; nothing if it is unknown (already popped).
        Safe to repeat, so that a tensor-parallel follower, which mirrors it, never meets an unknown id."""
        self.abort(request_id)
        self._reqs.pop(request_id, None)

    # ---- stepping ---------------------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Advance the engine by one step. Returns the requests that produced a token or finished in it.

        With overlap (the default) this launches step N+1 and only then reads step N's results, so the device never
        waits for the host between steps; the returned requests are those of step N. Without overlap the step is
        launched and its own results read at once."""
        early = []
        if (self._inflight is not None and self.scheduler.host_matching
                and any(r.host_matched for r in self.scheduler.running)):
            # a grammar row's mask needs the token the step in flight samples: read it first (constrain.host);
            # it leaves ``_inflight`` before the read, so that a read cut short is never read again
            pending, self._inflight = self._inflight, None
            early = self._read(pending)
            self.host_syncs += 1
        if self.scheduler.host_matching:
            self._check_grammars()
        launched = self._launch()
        self._last_plan = launched.plan if launched is not None else None
        failed, self._failed = self._failed, []
        if not self.ec.overlap:
            done = self._read(launched) if launched is not None else []
        else:
            previous, self._inflight = self._inflight, launched
            done = self._read(previous) if previous is not None else []
        # each request once (a grammar row that failed in ``_check_grammars`` may also have been read this step)
        return list({id(r): r for r in failed + early + done}.values()) if failed else early + done

    def set_step_costs(self, costs: dict) -> None:
        """The speculation policy's step costs, measured by another rank's engine (tensor parallelism: every rank
        must make the leader's choices)."""
        self.scheduler.policy.costs = dict(costs)

    def launched_plan(self) -> ScheduledBatch | None:
        """The host-side plan of the step the last ``step()`` launched (None if it launched none): benchmarks
        break their time down by it."""
        return self._last_plan

    def drain(self) -> list[Req]:
        """Read the launched, unread step (overlap loop), launching nothing new."""
        previous, self._inflight = self._inflight, None
        return self._read(previous) if previous is not None else []

    def _launch(self) -> "_Launched | None":
        sched = self.scheduler.schedule()
        if sched is None:
            return None
        policy = self.scheduler.policy
        timer = (StepTimer(self.device) if policy is not None and policy.adaptive and self.times_steps
                 and sched.mode is not ForwardMode.EXTEND else None)
        try:
            self._host_masks(sched)
            pool = self.caches.state_pool
            pool.copy(sched.copies_before)  # prefix-cache hits: their snapshots into the requests' slots
            res = self.worker.run(sched)
            if timer is not None:
                timer.stop()
            pool.copy(sched.copies_after)  # new snapshots of the states this step produced
        except BaseException as e:  # noqa: BLE001 - the step's own requests fail; the others go on
            # Nothing of this step was launched as far as the host's bookkeeping goes (step_launched did not run);
            # its rows' device state may be half-updated, so exactly these requests end, and their slots are freed
            # once their earlier in-flight steps (if any) are read.
            self.scheduler.step_failed(sched)
            self._end_cut_step(sched.reqs, e)
            self._failed.extend(sched.reqs)
            if not isinstance(e, Exception):
                raise
            return None
        self.host_reads.note_launch()
        read = self.host_reads.start(res.host_view())  # one copy for everything the host needs
        # prompt log probabilities (rare: requests that asked) come back by a second copy of their own
        prompt_read = self.host_reads.start(res.prompt_logprobs) if res.prompt_logprobs is not None else None
        self.scheduler.step_launched(sched)
        return _Launched(sched, read, prompt_read, timer)

    def _check_grammars(self) -> None:
        """Grammar rows the matcher gave up on end now, with a 400, not inside the step they would have shared
        (``constrain.host.grammars_given_up``)."""
        for req, error in grammars_given_up([*self.scheduler.running, *self.scheduler.waiting]):
            self._fail(req, error, status=400)
            self._failed.append(req)

    def _host_masks(self, sched: ScheduledBatch) -> None:
        """The masks of the step's host-matched rows that sample, into the device table before it launches (no
        step of theirs is in flight: ``step`` read it)."""
        if not self.scheduler.host_matching:
            return
        rows = [r for r, keep in zip(sched.reqs, sched.sample) if keep and r.host_matched]
        if rows:
            write_host_masks(rows, self.caches.req_slots.ensure_constraints(self.model_config.vocab_size,
                                                                            self.model_worker.eos_ids))

    def _read(self, launched: "_Launched") -> list[Req]:
        """``_complete``, and where it is cut (an interrupt while waiting for the device, most likely, or an
        internal error) the rows not yet read end: else their in-flight counts never fall and their slots stay held
        for good. Returns the step's requests then (the read ones may have new tokens, the others have ended)."""
        try:
            return self._complete(launched)
        except BaseException as e:  # noqa: BLE001 - the step's own requests fail; the others go on
            plan = launched.plan
            self._end_cut_step(plan.reqs[launched.rows_read:], e)
            self.scheduler.step_abandoned(plan, launched.rows_read)
            if not isinstance(e, Exception):
                raise
            return list({id(r): r for r in plan.reqs}.values())

    def _end_cut_step(self, reqs: list[Req], error: BaseException) -> None:
        """End the requests of a step cut by ``error`` (their states may be half-written, so nothing of theirs is
        cached): an internal error, logged once with its traceback, ends just them as a 500 and the engine goes
        on; an interrupt (KeyboardInterrupt, SystemExit) ends them the same way, and the caller raises it on."""
        if isinstance(error, Exception):
            self._log_internal_error(reqs, error)
            for req in reqs:
                self._fail(req, error, logged=True)
            return
        for req in reqs:
            req.use_prefix_cache = False
            if not req.finished:
                req.error, req.error_status = "the step serving the request was interrupted", 500
                self.scheduler.finish(req, "abort")

    def _complete(self, launched: "_Launched") -> list[Req]:
        """Read a launched step's results (waiting on its event) and apply them: tokens, stop rules, freeing."""
        sched = launched.plan
        rows = iter(launched.read.wait())
        prompt_values = launched.prompt_read.wait() if launched.prompt_read is not None else None
        verify = sched.mode is ForwardMode.TARGET_VERIFY
        width = self.ec.spec_tokens + 1 if verify else 1  # tokens per row; a verify row's count follows them
        top_n = max((r.params.logprobs for r, keep in zip(sched.reqs, sched.sample)
                     if keep and r.params.logprobs is not None), default=None)
        updated = []
        if prompt_values is not None:
            apply_prompt_logprobs(sched, prompt_values)
        policy = self.scheduler.policy
        if launched.timer is not None:  # the step's results are read: its end event has completed
            policy.observe_step(verify, len(sched.reqs), launched.timer.ms())
        accepted = []  # a verify step's accepted draft counts, for the policy
        for i, (req, n, keep) in enumerate(zip(sched.reqs, sched.extend_lens, sched.sample)):
            committed = n
            if keep:
                row = next(rows)
                new, count = row[:width], (row[width] if verify else 1)
                if verify and count > 0:
                    accepted.append(count - 1)
                # a verify row commits its last token and the accepted drafts: count - 1 of them
                committed = count if verify else n
                if not req.finished:
                    try:
                        lps = (unpack_logprobs(row[width + verify:], width, top_n, req.params.logprobs)
                               if top_n is not None and req.params.logprobs is not None else None)
                        self._apply_row(req, new, count, verify, lps, sched.mode is ForwardMode.DECODE)
                    except Exception as e:  # noqa: BLE001 - one request's host-side failure ends that request only
                        self._fail(req, e)
                    updated.append(req)
                else:  # finished while this step was in flight: its tokens are not output, but its state is theirs
                    req.extra_ids.extend(new[:count])
            self.scheduler.step_done(sched, i, committed)
            launched.rows_read = i + 1
        if verify:
            policy.observe_verify(accepted)
        return updated

    def _apply_row(self, req: Req, new: list[int], count: int, verify: bool, lps: list | None = None,
                   plain: bool = False) -> None:
        """``plain``: a speculative engine's step that decoded one token without drafts."""
        appended = 0
        for tok in new[:count]:
            if lps is not None:
                req.logprobs.append(lps[appended])
            appended += 1
            if self._append_token(req, tok):
                # the rest were computed all the same (their state is in the slot): the prefix cache needs them
                req.extra_ids.extend(new[appended:count])
                break
        stats = req.spec
        if verify:
            stats.verify_steps += 1
            stats.draft_tokens += self.ec.spec_tokens
            stats.accepted_tokens += count - 1
            stats.emitted_tokens += appended
            if count > 0:
                self.scheduler.policy.observe_row(req, count - 1)
        elif stats is not None and plain:
            stats.plain_steps += 1

    def _fail(self, req: Req, error: BaseException, status: int = 500, logged: bool = False) -> None:
        """End ``req`` because of an error raised while serving it: an internal one (status 500), logged with its
        traceback (it is the engine's fault, not the client's) unless ``logged``, or the request's own (status
        400, such as a grammar the matcher gave up on), whose message goes to the client and nothing to the log.
        The request finishes with finish_reason "abort" and ``error`` set, and every other request goes on."""
        if req.finished and req.error is not None:
            return
        if status >= 500:
            req.error = f"internal error while serving the request: {type(error).__name__}"
            if not logged:
                self._log_internal_error([req], error)
        else:
            req.error = str(error)
        req.error_status = status
        req.use_prefix_cache = False  # a step that failed half-way may have left its state half-written
        if not req.finished:
            self.scheduler.finish(req, "abort")

    @staticmethod
    def _log_internal_error(reqs: list[Req], error: BaseException) -> None:
        names = ", ".join(r.rid for r in reqs[:8]) + (f" and {len(reqs) - 8} more" if len(reqs) > 8 else "")
        print(f"[hylo] error: request{'s' * (len(reqs) > 1)} {names} failed:\n"
              + "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip(),
              file=sys.stderr, flush=True)

    def _append_token(self, req: Req, token: int) -> bool:
        """Append one generated token and apply the stop rules; True when the request finished."""
        reason = append_token(req, token, self.eos_ids, self.tokenizer, self.max_model_len)
        if reason is not None:
            self.scheduler.finish(req, reason)
        return reason is not None

    @torch.inference_mode()
    def prompt_logits(self, prompt: str | list[int]) -> torch.Tensor:
        """Logits at every prompt position ([L, vocab] float32), computed by chunked prefill through the caches.

        Runs on an idle engine only (it would otherwise advance other requests without sampling them).
        """
        if self.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        ids = self.encode_prompt(prompt)
        req = Req(rid=f"__prompt_logits_{next(self._ids)}", prompt_ids=ids, params=SamplingParams(max_tokens=1),
                  seed=0, use_prefix_cache=False)  # every position's logits: nothing may come from the cache
        self.scheduler.add(req)
        chunks = []
        try:
            while req.num_computed < len(ids):
                sched = self.scheduler.schedule()
                if sched is None:
                    raise RuntimeError(f"prompt_logits: the KV cache cannot hold the prompt's {len(ids)} tokens")
                hidden = self.model_worker.forward_hidden(self.model_worker.build_batch(sched))
                chunks.append(self.model.compute_logits(hidden).float())
                req.num_computed += sched.extend_lens[0]
        finally:
            self.scheduler.finish(req, "abort")
        return torch.cat(chunks)
