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

The overlap loop schedules step N+1 before it has read step N's results, so the plan is made from what the host
knows for sure: a request's computed tokens are bounded by ``Req.computed_bound`` (exact unless a verify is in
flight, then the bound assumes every draft is accepted), a decoding row's inputs come from the device tables, and a
request already certain to finish (its in-flight step reaches ``max_tokens`` or the context limit) is not scheduled.

Resource lifetime (the rules, in one place):
- A request's slots and KV locations go back to the free lists only when no launched step that uses them is still
  unread: ``finish`` and ``_preempt`` of a request in flight set ``release_deferred``, and ``step_done`` releases
  it when its last in-flight step's results are processed (which happens after that step's completion event).
  A request is therefore released exactly once, however it ended.
- A preempted request is not re-admitted while a step of its old run is in flight (its outputs are still arriving).
- KV reserved for the all-accepted case stays with the request until the host knows the real count; then
  ``step_done`` returns the surplus beyond what the next step can need.
"""

from __future__ import annotations

from collections import deque

import torch

from ..cache.memory import Caches, positions_ahead
from ..cache.prefix_cache import PrefixCache
from ..config import EngineConfig
from ..core import ForwardMode, Req, ReqStatus
from .plan import ScheduledBatch
from .prefix_reuse import PrefixReuse
from .spec_policy import DraftPolicy, StepChoice


class Scheduler:
    def __init__(self, caches: Caches, ec: EngineConfig, num_spec_tokens: int = 0,
                 prefix_cache: PrefixCache | None = None, decode_matches_prefill: bool = True):
        self.caches = caches
        # where a decode step computes a token's state differently from a prefill (Mamba2's clamped dt), a resumed
        # request's chunks stop at its prompt's end: its outputs, computed again, are then a chunk of their own that
        # runs as decoding computed them (``ScheduledBatch.generated``)
        self.cut_at_prompt_end = not decode_matches_prefill
        self.ec = ec
        self.k = num_spec_tokens
        # set once a request whose constraint is matched on the host arrives: only then do steps look for one
        self.host_matching = False
        # with speculation: whether each step of decoding rows verifies drafts or decodes plainly
        self.policy = (DraftPolicy(num_spec_tokens, adaptive=ec.spec_policy == "adaptive")
                       if num_spec_tokens else None)
        self.cache = prefix_cache  # the tree (None: prefix caching off): its locks and eviction
        # what admission, release and prefill chunks ask of it
        self.reuse = (PrefixReuse(prefix_cache, ec.prefix_state_interval or ec.chunk_size)
                      if prefix_cache is not None else None)
        # an upper bound of the positions reserved past the fed tokens (see _kv_end)
        self.kv_lookahead = positions_ahead(num_spec_tokens)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # in admission order
        self._last_was_prefill = False

    # ---- queue ------------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, req: Req, reason: str) -> None:
        """End a request and return every resource it holds (once its in-flight steps are done with them)."""
        req.finish_reason = req.finish_reason or reason
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            self._release_when_idle(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED

    def _release_when_idle(self, req: Req) -> None:
        if req.inflight:
            req.release_deferred = True
        else:
            self._release(req)

    def _release(self, req: Req) -> None:
        c = self.caches
        own = torch.cat(req.kv_locs) if req.kv_locs else torch.empty(0, dtype=torch.int64)
        keep_state = False
        if self.reuse is not None:
            keep_state, own = self.reuse.on_release(req, own)
        if own.numel():
            c.kv_pool.free(own)
        req.kv_locs = []
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        if req.req_slot > 0:
            c.req_slots.free(req.req_slot)
        if req.state_slot > 0 and not keep_state:
            c.state_pool.free(req.state_slot)
        req.req_slot = req.state_slot = -1
        req.num_kv = req.prefix_len = req.state_len = 0
        req.decoded_state = False
        req.release_deferred = False

    def _preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._release_when_idle(req)
        req.status = ReqStatus.WAITING
        req.num_computed = 0
        req.decoding = False
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def is_decoding(self, req: Req) -> bool:
        """Prefill done: the last launched row sampled, so the next row feeds the newest token."""
        return req.decoding

    # ---- launch and completion bookkeeping --------------------------------------------------------------------
    def step_launched(self, plan: ScheduledBatch) -> None:
        """Record that ``plan`` runs on the device; its results arrive later through ``step_done``."""
        verify = plan.mode is ForwardMode.TARGET_VERIFY
        # which rows' next step can verify: a prefill row that sampled, a verify row and a drafting plain row drafted
        drafted = verify or plan.draft_after or plan.mode is ForwardMode.EXTEND
        for req, n, keep, gen in zip(plan.reqs, plan.extend_lens, plan.sample, plan.generated):
            req.has_drafts = drafted and keep
            req.inflight += 1
            req.inflight_advance += n  # a verify row commits k + 1 tokens at most
            req.inflight_verify += verify
            req.inflight_new += keep
            req.decoding = req.decoding or keep
            req.decoded_state = req.decoded_state or gen  # (every row of a DECODE or TARGET_VERIFY step decodes)

    def step_failed(self, plan: ScheduledBatch) -> None:
        """``plan`` was never launched (its launch raised): give back what it reserved for its completion."""
        if self.reuse is not None:
            self.reuse.drop_snapshots(plan)

    def step_abandoned(self, plan: ScheduledBatch, first_row: int) -> None:
        """Reading ``plan``'s results was cut at row ``first_row`` (the rows from there on have ended): they complete
        committing nothing, and the snapshots they reserved go back (their states may be half-written)."""
        if self.reuse is not None:
            self.reuse.drop_snapshots(plan, first_row)
        for row in range(first_row, len(plan.reqs)):
            self.step_done(plan, row, 0)

    def step_done(self, plan: ScheduledBatch, row: int, committed: int) -> None:
        """Row ``row`` of ``plan`` completed and committed ``committed`` tokens to the caches."""
        req = plan.reqs[row]
        req.state_len += committed
        if row in plan.snapshots:
            self.reuse.add_chunk_snapshot(req, *plan.snapshots[row])
        req.inflight -= 1
        req.inflight_advance -= plan.extend_lens[row]
        req.inflight_verify -= plan.mode is ForwardMode.TARGET_VERIFY
        req.inflight_new -= plan.sample[row]
        if req.status is ReqStatus.RUNNING:
            req.num_computed += committed
            if not req.inflight_verify:
                self._trim_kv(req)
        if req.release_deferred and not req.inflight:
            self._release(req)

    def _trim_kv(self, req: Req) -> None:
        """Return KV reserved past what the next step can need (the surplus of an all-accepted reservation)."""
        if not req.decoding:
            return
        keep = self._kv_end(req, self.k + 1 if self.k else 1, True, req.computed_bound)
        if req.num_kv <= keep or not req.kv_locs:
            return
        locs = torch.cat(req.kv_locs)  # positions prefix_len ..
        self.caches.kv_pool.free(locs[keep - req.prefix_len:])
        req.kv_locs = [locs[:keep - req.prefix_len]]
        req.num_kv = keep

    def _still_needed(self, req: Req) -> int:
        """KV locations a running request may still take before it decodes on: the rest of its prefill, then one
        more step's (``kv_lookahead + 1``)."""
        c = req.computed_bound
        rest = 0 if req.decoding else max(0, self._kv_end(req, req.num_tokens - c, False, c) - req.num_kv)
        return rest + self.kv_lookahead + 1

    def _ends_within(self, req: Req, more: int) -> bool:
        """``more`` output tokens beyond those the host has reach the request's max_tokens or the context limit."""
        return (len(req.output_ids) + more >= req.params.max_tokens
                or req.num_tokens + more >= self.caches.max_model_len)

    def _surely_done(self, req: Req) -> bool:
        """The in-flight steps' outputs alone finish the request (max_tokens or the context limit)."""
        return req.inflight_new > 0 and self._ends_within(req, req.inflight_new)

    def _may_end_in_flight(self, req: Req) -> bool:
        """A verify in flight may finish the request (its max_tokens or the context limit) if it accepts enough
        drafts. A plain step after it would compute a token past the end (a verify row there is inert instead,
        see ``speculative.verify.accept_limit``): the next step verifies instead where every row has drafts, and
        otherwise such a request waits for the verify's results. Its state then ends where its output does, which
        is where its conversation's next turn resumes from the prefix cache."""
        return req.inflight_verify > 0 and self._ends_within(req, req.inflight_new + self.k * req.inflight_verify)

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        if self.k == 0:
            return self._schedule(self.running, prefill=True, decode=True)
        decoding = [r for r in self.running if r.decoding]
        wants_prefill = len(decoding) < len(self.running) or bool(self.waiting)
        if wants_prefill and (not decoding or not self._last_was_prefill):
            batch = self._schedule(self.running, prefill=True, decode=False)
            if batch is not None:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        if not decoding:
            return None
        rows = [r for r in decoding if not self._surely_done(r)] or decoding
        choice = self.policy.choose(rows)
        if not choice.verify and all(r.has_drafts for r in rows) and any(map(self._may_end_in_flight, rows)):
            # a verify in flight may end one of them: verify again (a row past its request's end is inert there,
            # where a plain step would compute a token past it) rather than hold the row back for a step
            choice = StepChoice(True, True)
        if self.host_matching and any(r.host_matched for r in decoding):
            # last, over everything: a host-matched grammar's mask needs each token before the next (and no verify
            # is in flight then, the engine having read it first)
            choice = StepChoice(False, False)
        plan = self._schedule(self.running, prefill=False, decode=True, decode_len=self.k + 1 if choice.verify else 1)
        if plan is not None:
            plan.mode = ForwardMode.TARGET_VERIFY if choice.verify else ForwardMode.DECODE
            plan.draft_after = choice.verify or choice.draft_after
        return plan

    def _schedule(self, candidates: list[Req], prefill: bool, decode: bool, decode_len: int = 1
                  ) -> ScheduledBatch | None:
        """The step's rows: decoding rows (``decode``) feeding ``decode_len`` tokens each, prefill chunks and
        admissions (``prefill``)."""
        budget = self.ec.chunk_size
        plan = ScheduledBatch([], [], [], [], ForwardMode.EXTEND)
        pending = list(candidates)  # oldest first; preemption victims are taken from the end
        width = self.caches.req_slots.max_context
        while pending:
            req = pending.pop(0)
            is_decode = req.decoding
            if (is_decode and not decode) or (not is_decode and not prefill):
                continue
            c = req.computed_bound
            if is_decode:
                if self._surely_done(req) or (decode_len == 1 and self.k and self._may_end_in_flight(req)):
                    continue
                n = decode_len
            else:  # a prefilling request has no verify in flight: c is exact and its tokens are on the host
                n = self._chunk(req, c, budget)
                if n <= 0:
                    continue
            end = self._kv_end(req, n, is_decode, c)
            if end > width:  # only with a verify in flight near the context limit: wait for the real count
                continue
            if not self._reserve(req, end, pending, plan):
                continue
            if not is_decode:
                budget -= n
            self._add_row(plan, req, n, is_decode, c)

        while prefill and self.waiting and budget > 0:
            req = self.waiting[0]
            if req.inflight:  # preempted while in flight: its last outputs are still arriving
                break
            if self.caches.req_slots.num_free == 0 or self.caches.state_pool.num_free == 0:
                break
            cached = self.reuse is not None and req.use_prefix_cache
            hit, req.branch_point = self.reuse.lookup(req) if cached else (None, 0)
            m = hit.length if hit is not None else 0
            n = self._chunk(req, m, budget)
            need = self._kv_end(req, n, False, m) - m  # new locations (a waiting request holds none)
            # Admitted only when its whole prefill fits beside what the running requests still need (one more step
            # each, and the rest of their prefills): admitted on its first chunk alone, a long prompt would be
            # preempted by its neighbours' growth before its last chunk and computed again, over and over.
            whole = self._kv_end(req, req.num_tokens - m, False, m) - m
            room = sum(self._still_needed(r) for r in self.running)
            if hit is not None:
                self.cache.lock(hit.node)  # before any eviction below can take it
            if self.caches.kv_pool.num_free < whole + room and not self._evict_for(whole + room):
                if hit is not None:
                    self.cache.unlock(hit.node)
                break
            self.waiting.popleft()
            req.req_slot = self.caches.req_slots.alloc()
            req.state_slot = self.caches.state_pool.alloc()
            req.status = ReqStatus.RUNNING
            req.num_computed = req.num_kv = req.prefix_len = req.state_len = req.last_snapshot = 0
            req.decoded_state = False
            req.extra_ids = []
            req.prompt_logprobs = []  # computed again from the first position (after a preemption too)
            req.decoding = False
            self.running.append(req)
            plan.admitted.append(req)
            if cached:
                self.reuse.use_hit(req, hit, plan)
            reserved = self._reserve(req, m + need, [], plan)
            assert reserved
            self._add_row(plan, req, n, False, m)
            budget -= n

        if not plan.reqs:
            return None
        # with speculation prefill rows never share a step with decoding rows, whose mode schedule() names. A
        # prompt's one-token chunk keeps the step EXTEND: the Mamba2 families compute prompt tokens as their
        # reference's prefill does (dt clamped), generated ones as its decode step (not clamped)
        if not self.k and all(plan.from_device):
            plan.mode = ForwardMode.DECODE
        return plan

    def _add_row(self, plan: ScheduledBatch, req: Req, n: int, is_decode: bool, c: int) -> None:
        plan.reqs.append(req)
        plan.extend_lens.append(n)
        plan.prefix_lens.append(c)  # exact, except for a verify row behind a verify in flight (an upper bound)
        # a verify row feeds its last token plus k drafts; the drafts are not in req's tokens
        plan.sample.append(is_decode or c + n == req.num_tokens)
        plan.from_device.append(is_decode)
        plan.generated.append(c >= len(req.prompt_ids))
        if self.reuse is not None and req.use_prefix_cache and not is_decode:
            self.reuse.plan_chunk_snapshot(plan, req, c + n)

    def _chunk(self, req: Req, c: int, budget: int) -> int:
        """Prefill tokens for ``req`` after ``c`` computed ones: the budget's worth, cut at its branch point (and
        at its prompt's end, see ``cut_at_prompt_end``)."""
        n = min(req.num_tokens - c, budget)
        if c < req.branch_point < c + n:
            n = req.branch_point - c
        if self.cut_at_prompt_end and c < len(req.prompt_ids) < c + n:
            n = len(req.prompt_ids) - c
        return n

    def _evict_for(self, need: int) -> bool:
        """Evict cached KV until ``need`` locations are free; whether they are."""
        kv = self.caches.kv_pool
        if self.cache is not None and kv.num_free < need and kv.num_free + self.cache.evictable_kv >= need:
            self.cache.evict_kv(need - kv.num_free)
        return kv.num_free >= need

    def _kv_end(self, req: Req, n: int, is_decode: bool, c: int) -> int:
        """Positions (exclusive) that need KV locations before a step that feeds ``n`` tokens after ``c`` computed
        ones: the fed tokens and, with speculation, the positions written ahead of them (``positions_ahead`` for a
        decoding row; the last prefill chunk's chained drafts reach k - 1 past it)."""
        end = c + n
        if self.k:
            if is_decode:
                end = c + self.kv_lookahead
            elif end == req.num_tokens:
                end += self.k - 1
        return end

    def _reserve(self, req: Req, end: int, pending: list[Req], plan: ScheduledBatch) -> bool:
        """Reserve KV locations for positions up to ``end``, preempting the newest pending requests if needed.
        False if ``req`` itself had to be preempted."""
        need = max(0, end - req.num_kv)
        if need == 0:  # reserved ahead already (a verify step that accepted few drafts)
            return True
        kv = self.caches.kv_pool
        locs = kv.alloc(need)
        if locs is None and self._evict_for(need):  # the cache gives way before any running request does
            locs = kv.alloc(need)
        while locs is None and pending:
            victim = pending.pop()  # the newest request not yet scheduled in this step
            self._preempt(victim)
            if victim.release_deferred:  # its KV returns when its in-flight step completes: wait for that
                return False
            locs = kv.alloc(need)
        if locs is None:
            self._preempt(req)
            return False
        if need:
            plan.kv_starts.append((req.req_slot, req.num_kv))
            plan.kv_locs.append(locs)
            req.kv_locs.append(locs)
            req.num_kv = end
        return True
