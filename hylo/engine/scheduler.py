"""The scheduler: which requests run in the next step, how many tokens each feeds, and where their KV goes.

Policy, in one place:
1. Running requests, oldest first, feed what is left of their tokens: one token for a decoding request (k + 1 with
   speculative decoding: the last token and k drafts), a chunk for a request still prefilling. Prefill tokens of a
   step share the ``chunk_size`` budget; decode tokens ride along outside it.
2. A running request that cannot get KV preempts the newest running request (its caches are freed; it goes back
   to the front of the queue and is re-run from its prompt and the tokens it already generated).
3. Waiting requests are admitted, in order, while a request slot, a state slot, prefill budget and KV remain.
4. With speculative decoding, prefill chunks and verify passes run in separate steps (their shapes differ), taking
   turns when both are wanted.
KV is reserved ahead of what a step feeds (``kv_lookahead``): a verify pass and the draft steps after it write
positions beyond the last committed token. Positions past the committed ones hold garbage that later steps
overwrite. Nothing here touches the device except through the caches' host-side free lists.
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
    extend_lens: list[int]  # tokens fed per row
    prefix_lens: list[int]  # tokens already in the cache per row
    sample: list[bool]  # row produces a token in this step (its last known token is fed)
    mode: ForwardMode
    # newly reserved KV positions: req_to_token[kv_rows[i], kv_cols[i]] = kv_locs[i]
    kv_rows: list[int] = field(default_factory=list)
    kv_cols: list[int] = field(default_factory=list)
    kv_locs: list[torch.Tensor] = field(default_factory=list)
    preempted: list[Req] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class Scheduler:
    def __init__(self, caches: Caches, ec: EngineConfig, num_spec_tokens: int = 0):
        self.caches = caches
        self.ec = ec
        self.k = num_spec_tokens
        # an upper bound of the positions reserved past the fed tokens (see _kv_end)
        self.kv_lookahead = 2 * num_spec_tokens
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in admission order
        self._arrivals = 0
        self._last_was_prefill = False

    # ---- queue ------------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

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
        req.num_computed = req.num_kv = 0

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def is_decoding(self, req: Req) -> bool:
        """Prefill done (a token was generated) and only the newest token is left to feed."""
        return bool(req.output_ids) and req.num_tokens - req.num_computed == 1

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        if self.k == 0:
            return self._schedule(self.running, prefill=True, decode=True)
        decoding = [r for r in self.running if self.is_decoding(r)]
        wants_prefill = len(decoding) < len(self.running) or bool(self.waiting)
        if wants_prefill and (not decoding or not self._last_was_prefill):
            batch = self._schedule(self.running, prefill=True, decode=False)
            if batch is not None:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        return self._schedule(self.running, prefill=False, decode=True) if decoding else None

    def _schedule(self, candidates: list[Req], prefill: bool, decode: bool) -> ScheduledBatch | None:
        budget = self.ec.chunk_size
        plan = ScheduledBatch([], [], [], [], ForwardMode.EXTEND)
        pending = list(candidates)  # oldest first; preemption victims are taken from the end
        while pending:
            req = pending.pop(0)
            is_decode = self.is_decoding(req) if self.k else req.num_tokens - req.num_computed == 1
            if (is_decode and not decode) or (not is_decode and not prefill):
                continue
            remaining = req.num_tokens - req.num_computed
            n = (self.k + 1 if self.k else 1) if is_decode else min(remaining, budget)
            if n == 0:
                continue
            if not self._reserve(req, self._kv_end(req, n, is_decode), pending, plan):
                continue
            if not is_decode:
                budget -= n
            self._add_row(plan, req, n, is_decode)

        while prefill and self.waiting and budget > 0:
            req = self.waiting[0]
            n = min(req.num_tokens, budget)
            need = self._kv_end(req, n, False)  # a waiting request holds no KV (num_computed is 0)
            # keep room for one more step of every running request, so admissions do not force preemptions at once
            room = len(self.running) * (self.kv_lookahead + 1)
            if (self.caches.kv_pool.num_free < need + room or self.caches.req_slots.num_free == 0
                    or self.caches.state_pool.num_free == 0):
                break
            self.waiting.popleft()
            req.req_slot = self.caches.req_slots.alloc()
            req.state_slot = self.caches.state_pool.alloc()
            req.status = ReqStatus.RUNNING
            req.num_computed = req.num_kv = 0
            req.arrival = self._arrivals
            self._arrivals += 1
            self.running.append(req)
            reserved = self._reserve(req, need, [], plan)
            assert reserved
            self._add_row(plan, req, n, False)
            budget -= n

        if not plan.reqs:
            return None
        if self.k:
            if all(self.is_decoding(r) for r in plan.reqs):  # prefill rows never share a step with verify rows
                plan.mode = ForwardMode.TARGET_VERIFY
        elif all(n == 1 for n in plan.extend_lens) and all(plan.sample):
            plan.mode = ForwardMode.DECODE
        return plan

    def _add_row(self, plan: ScheduledBatch, req: Req, n: int, is_decode: bool) -> None:
        plan.reqs.append(req)
        plan.extend_lens.append(n)
        plan.prefix_lens.append(req.num_computed)
        # a verify row feeds its last token plus k drafts; the drafts are not in req's tokens
        plan.sample.append(is_decode or req.num_computed + n == req.num_tokens)

    def _kv_end(self, req: Req, n: int, is_decode: bool) -> int:
        """Positions (exclusive) that need KV locations before this step: the fed tokens and, with speculation, the
        positions written ahead of them. A verify row feeds positions c..c+k (c = num_computed) and the k - 1
        chained drafts after it reach c + 2k - 1; the last prefill chunk's chained drafts reach k - 1 past it."""
        end = req.num_computed + n
        if self.k:
            if is_decode:
                end = req.num_computed + 2 * self.k
            elif end == req.num_tokens:
                end += self.k - 1
        return end

    def _reserve(self, req: Req, end: int, pending: list[Req], plan: ScheduledBatch) -> bool:
        """Reserve KV locations for positions up to ``end``, preempting the newest pending requests if needed.
        False if ``req`` itself had to be preempted."""
        need = max(0, end - req.num_kv)
        kv = self.caches.kv_pool
        locs = kv.alloc(need)
        while locs is None and pending:
            victim = pending.pop()  # the newest request not yet scheduled in this step
            self._preempt(victim)
            plan.preempted.append(victim)
            locs = kv.alloc(need)
        if locs is None:
            self._preempt(req)
            plan.preempted.append(req)
            return False
        if need:
            plan.kv_rows.extend([req.req_slot] * need)
            plan.kv_cols.extend(range(req.num_kv, end))
            plan.kv_locs.append(locs)
            req.kv_locs.append(locs)
            req.num_kv = end
        return True
