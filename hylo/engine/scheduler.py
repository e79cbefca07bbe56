"""The scheduler: which requests run in the next step, how many tokens each feeds, and where their KV goes.

Policy, in one place:
1. Running requests, oldest first, each feed what is left of their tokens: one token for a decoding request, a
   chunk for a request still prefilling (prefill tokens of a step share the ``chunk_size`` budget; decode tokens
   ride along outside it).
2. A running request that cannot get KV preempts the newest running request (its caches are freed; it goes back
   to the front of the queue and is re-run from its prompt and the tokens it already generated).
3. Waiting requests are admitted, in order, while a request slot, a state slot, prefill budget and KV remain.
Nothing here touches the device except through the caches' own host-side free lists.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache.memory import Caches
from ..config import EngineConfig
from ..core import ForwardMode, Req, ReqStatus


@dataclass
class ScheduledBatch:
    """The host-side plan of one step."""

    reqs: list[Req]
    extend_lens: list[int]
    prefix_lens: list[int]
    sample: list[bool]  # row produces a token in this step (its last known token is fed)
    out_cache_loc: torch.Tensor  # [T] host int64, KV location of every fed token
    mode: ForwardMode
    preempted: list[Req] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class Scheduler:
    def __init__(self, caches: Caches, ec: EngineConfig):
        self.caches = caches
        self.ec = ec
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in admission order
        self._arrivals = 0

    # ---- queue ------------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def find(self, rid: str) -> Req | None:
        for r in self.running:
            if r.rid == rid:
                return r
        for r in self.waiting:
            if r.rid == rid:
                return r
        return None

    def finish(self, req: Req, reason: str) -> None:
        """End a request and return every resource it holds."""
        req.finish_reason = req.finish_reason or reason
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED

    def _release(self, req: Req) -> None:
        c = self.caches
        if req.kv_locs:
            c.kv_pool.free(torch.cat(req.kv_locs))
            req.kv_locs = []
        if req.req_slot > 0:
            c.req_slots.free(req.req_slot)
        if req.state_slot > 0:
            c.state_pool.free(req.state_slot)
        req.req_slot = req.state_slot = -1
        req.num_computed = 0

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        kv = self.caches.kv_pool
        budget = self.ec.chunk_size
        rows: list[tuple[Req, int, torch.Tensor]] = []
        preempted: list[Req] = []

        pending = list(self.running)  # oldest first; victims are taken from the end
        while pending:
            req = pending.pop(0)
            remaining = req.num_tokens - req.num_computed
            n = 1 if remaining == 1 else min(remaining, budget)
            if n == 0:
                continue
            locs = kv.alloc(n)
            while locs is None and pending:
                victim = pending.pop()  # the newest request not yet scheduled in this step
                self._preempt(victim)
                preempted.append(victim)
                locs = kv.alloc(n)
            if locs is None:  # nobody left to preempt but itself
                self._preempt(req)
                preempted.append(req)
                continue
            if remaining > 1:
                budget -= n
            rows.append((req, n, locs))

        while self.waiting and budget > 0:
            req = self.waiting[0]
            n = min(req.num_tokens, budget)
            # keep room for one more token per running request, so admissions do not force preemptions at once
            if kv.num_free < n + len(self.running) or self.caches.req_slots.num_free == 0 \
                    or self.caches.state_pool.num_free == 0:
                break
            self.waiting.popleft()
            req.req_slot = self.caches.req_slots.alloc()
            req.state_slot = self.caches.state_pool.alloc()
            req.status = ReqStatus.RUNNING
            req.num_computed = 0
            req.arrival = self._arrivals
            self._arrivals += 1
            self.running.append(req)
            rows.append((req, n, kv.alloc(n)))
            budget -= n

        if not rows:
            return None
        reqs, extend_lens, prefix_lens, sample, locs = [], [], [], [], []
        for req, n, loc in rows:
            reqs.append(req)
            extend_lens.append(n)
            prefix_lens.append(req.num_computed)
            sample.append(req.num_computed + n == req.num_tokens)
            locs.append(loc)
            req.kv_locs.append(loc)
        decode = all(n == 1 for n in extend_lens) and all(sample)
        return ScheduledBatch(reqs, extend_lens, prefix_lens, sample, torch.cat(locs),
                              ForwardMode.DECODE if decode else ForwardMode.EXTEND, preempted)
