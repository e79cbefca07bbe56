"""The engine loop beside the event loop.

One thread owns the engine and does nothing but step it; HTTP handlers talk to it through a thread-safe inbox
(add / abort) and get their tokens back through one asyncio queue per request, filled with
``loop.call_soon_threadsafe``. Nothing the engine thread does can wait for a client: a slow reader only lets its
own queue grow, and a request that fails validation is answered with an error without touching the others.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..core import Req
from ..sampling_params import SamplingParams
from ..engine.detok import settled_length
from ..engine.engine import Engine
from .metrics import Metrics


@dataclass
class Delta:
    """What a request produced since the last delta (``text`` held back while it could still become a stop
    string). ``finish_reason`` is set on the last one; ``error`` on a request the engine refused."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's field)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    logprobs: list = field(default_factory=list)  # TokenLogprobs of ``token_ids``, when the request asked
    prompt_logprobs: list | None = None  # on the first delta of a request that asked for them
    error: str | None = None
    status: int = 400  # the HTTP status of ``error``: 400 for a request the engine refused, 500 for its own failure


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    req: Req | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    started: float = 0.0
    last_token_at: float | None = None
    sent_prompt: bool = False  # its prompt log probabilities went out


class EngineThread:
    def __init__(self, engine: Engine, metrics: Metrics | None = None, idle_wait_s: float = 0.05):
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hylo-engine", daemon=True)
        self.error: str | None = None  # set if the loop died: /health reports it
        self.metrics.prefix = getattr(engine, "prefix_cache", None)
        self.metrics.automata = getattr(engine, "automata", None)
        self.metrics.engine = engine
        caches = getattr(engine, "caches", None)
        if caches is not None:
            kv = caches.kv_pool
            self.metrics.prefix_slot_bytes = caches.slot_bytes
            self.metrics.prefix_kv_token_bytes = kv.bytes // max(kv.num_tokens + 1, 1)

    # ---- called from the event loop ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, rid: str, prompt, params: SamplingParams) -> asyncio.Queue:
        """Queue a request; its deltas arrive on the returned queue (the first may be an error)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", rid, prompt, params, _Stream(loop, q, started=time.perf_counter())))
        return q

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    # ---- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                busy = eng.has_unfinished()
                self._drain_inbox(block=not busy)
                if not eng.has_unfinished():
                    self._update_gauges()
                    continue
                # The engine fails a request it cannot serve (its error set, finish_reason "abort") and goes on with
                # the others, so an error raised for one request never reaches this loop.
                updated = eng.step()
                now = time.perf_counter()
                for req in updated:
                    self._publish(req, now)
                self._update_gauges()
        except BaseException:  # noqa: BLE001 - reported through /health and to every waiting client
            self.error = traceback.format_exc()
            for rid, s in list(self._streams.items()):
                self._send(s, Delta(error="the engine stopped with an internal error", finish_reason="abort",
                                    status=500))
            self._streams.clear()
            raise

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        eng = self.engine
        if item[0] == "add":
            _, rid, prompt, params, stream = item
            try:
                eng.add_request(prompt, params, request_id=rid)
            except ValueError as e:
                self.metrics.rejected += 1
                self._send(stream, Delta(error=str(e)))
                return
            except Exception as e:  # noqa: BLE001 - the engine's fault, not the client's: logged, answered with 500
                print(f"[hylo] error: adding request {rid} failed:\n{traceback.format_exc().rstrip()}",
                      file=sys.stderr, flush=True)
                self._send(stream, Delta(error=f"internal error while adding the request: {type(e).__name__}",
                                         status=500))
                return
            stream.req = eng.request(rid)
            self._streams[rid] = stream
            self.metrics.requests_started += 1
        elif item[0] == "abort":
            rid = item[1]
            stream = self._streams.get(rid)
            if stream is not None and eng.abort(rid):
                self._publish(stream.req, time.perf_counter())

    def _publish(self, req: Req, now: float) -> None:
        stream = self._streams.get(req.rid)
        if stream is None:
            return
        m = self.metrics
        new_tokens = req.output_ids[stream.sent_tokens:]
        if new_tokens:
            if stream.sent_tokens == 0:
                m.ttft.observe(now - stream.started)
            elif stream.last_token_at is not None:
                # tokens that arrive together (a verify step) share the interval
                per = (now - stream.last_token_at) / len(new_tokens)
                for _ in new_tokens:
                    m.token_latency.observe(per)
            stream.last_token_at = now
            m.generated_tokens += len(new_tokens)
        text = req.text or ""
        safe = max(stream.sent_chars, settled_length(req))  # (what may still become a stop string waits)
        delta = Delta(text=text[stream.sent_chars:safe], token_ids=list(new_tokens),
                      prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                      cached_tokens=req.num_cached_tokens,
                      logprobs=req.logprobs[stream.sent_tokens:len(req.output_ids)] if req.params.logprobs is not None
                      else [])
        if req.params.prompt_logprobs is not None and not stream.sent_prompt and (new_tokens or req.finished):
            delta.prompt_logprobs = list(req.prompt_logprobs) or [None]
            stream.sent_prompt = True
        stream.sent_tokens = len(req.output_ids)
        stream.sent_chars = max(stream.sent_chars, safe)
        if req.error is not None:
            delta.error, delta.status = req.error, req.error_status
        if req.finished:
            delta.finish_reason, delta.stop_reason = req.finish_reason, req.stop_reason
            m.finished(req)
            self._streams.pop(req.rid, None)
            self.engine.pop_finished(req.rid)
        if delta.text or delta.token_ids or delta.finish_reason or delta.error:
            self._send(stream, delta)

    @staticmethod
    def _send(stream: _Stream, delta: Delta) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
        except RuntimeError:  # the client's event loop is gone (server shutting down)
            pass

    def _update_gauges(self) -> None:
        eng, m = self.engine, self.metrics
        sched, caches = eng.scheduler, eng.caches
        m.running = len(sched.running)
        m.waiting = len(sched.waiting)
        m.req_slots_used = caches.req_slots.num_used
        m.req_slots_total = caches.req_slots.max_num_seqs
        m.kv_used = caches.kv_pool.num_tokens - caches.kv_pool.num_free
        m.kv_total = caches.kv_pool.num_tokens
