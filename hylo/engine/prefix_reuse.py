"""The scheduler's side of the prefix cache: what an admitted request reuses, which prefill chunks leave a state
snapshot, and what a request's tokens, KV and state slot give the tree when it ends.

The tree itself (matching, insertion, eviction, the snapshot slots) is ``cache/prefix_cache.py``; this module only
decides, from a request's host-side bookkeeping, when to call it. Every call happens on the host while planning a
step or processing its results, never between a launch and its completion.
"""

from __future__ import annotations

import torch

from ..cache.prefix_cache import Hit, PrefixCache
from ..core import Req
from .plan import ScheduledBatch


class PrefixReuse:
    def __init__(self, cache: PrefixCache, snapshot_interval: int):
        self.cache = cache
        # a prefill chunk ending this many tokens past the request's last snapshot leaves another one
        self.snapshot_interval = snapshot_interval

    # ---- admission --------------------------------------------------------------------------------------------
    def lookup(self, req: Req) -> tuple[Hit | None, int]:
        """The cached prefix a waiting request can reuse (not yet locked), and its branch point: where its tokens
        leave those the tree holds, if past the hit (a later request sharing them would want a snapshot there;
        0 for none)."""
        tokens = req.prompt_ids + req.output_ids
        hit = self.cache.match(tokens)
        m = hit.length if hit is not None else 0
        held = self.cache.held(tokens)
        return hit, held if m < held < len(tokens) else 0

    def use_hit(self, req: Req, hit: Hit | None, plan: ScheduledBatch) -> None:
        """A newly admitted request reuses a cached prefix (``hit``, already locked): its KV locations are shared
        (written into ``req_to_token`` like new ones), the snapshot is copied into its state slot before the step."""
        if req.num_preemptions == 0:  # the hit rate counts each request's prompt once
            self.cache.stats.queried_tokens += req.num_tokens
            self.cache.stats.hit_tokens += hit.length if hit is not None else 0
            req.num_cached_tokens = hit.length if hit is not None else 0
        if hit is None:
            return
        if req.num_preemptions:
            self.cache.stats.resumed_tokens += hit.length
        req.cache_node, req.prefix_len = hit.node, hit.length
        req.num_computed = req.num_kv = req.state_len = req.last_snapshot = hit.length
        plan.kv_starts.append((req.req_slot, 0))
        plan.kv_locs.append(hit.locs)
        plan.copies_before.append((hit.snapshot, req.state_slot))
        plan.hits.append((req, hit.length))

    # ---- prefill chunks ---------------------------------------------------------------------------------------
    def plan_chunk_snapshot(self, plan: ScheduledBatch, req: Req, end: int) -> None:
        """Keep the state after a prefill chunk ending at ``end`` when it ends the known tokens (the prompt) or
        ``snapshot_interval`` tokens passed since the request's last snapshot: a copy of the slot queued after the
        step, added to the tree when the row completes (by then the token after ``end`` is known)."""
        if end < req.num_tokens and end - req.last_snapshot < self.snapshot_interval and end != req.branch_point:
            return
        if end <= req.prefix_len:
            return
        if end > len(req.prompt_ids) and not self.cache.decoded_states:  # a resumed request's outputs, computed
            return  # as decoding computes them (Scheduler.cut_at_prompt_end): not what a next turn's prefill gives
        slot = self.cache.reserve_snapshot()
        if slot is None:
            return
        req.last_snapshot = end
        plan.snapshots[len(plan.reqs) - 1] = (end, slot)
        plan.copies_after.append((req.state_slot, slot))

    def add_chunk_snapshot(self, req: Req, end: int, slot: int) -> None:
        """The row that made a chunk snapshot completed: its tokens [0, end) and the snapshot go into the tree, and
        the request's shared prefix grows to ``end`` (the tree owns those locations now)."""
        tokens = req.known_tokens(end + 1)
        kept = False
        if len(tokens) >= end and req.req_slot > 0 and req.num_kv >= end > req.prefix_len:
            own = torch.cat(req.kv_locs)
            # the tree takes our locations for the positions it does not hold yet (where another request computed
            # these tokens first, it keeps its own and ours stay ours until the request ends)
            node, held = self.cache.insert(tokens[:end], own, req.prefix_len, tokens[end] if len(tokens) > end else -1)
            kept = self.cache.add_snapshot(node, slot)
            if held < end:  # we gave the tree locations we still use: hold them against eviction
                self.cache.lock(node)
                if req.cache_node is not None:
                    self.cache.unlock(req.cache_node)
                req.cache_node = node
                if held == req.prefix_len:  # all of [prefix_len, end) is the tree's now: our share starts at end
                    req.kv_locs = [own[end - req.prefix_len:]]
                    req.prefix_len = end
        if not kept:
            self.cache.drop_reserved(slot)

    def drop_snapshots(self, plan: ScheduledBatch, first_row: int = 0) -> None:
        """The snapshot slots ``plan`` reserved for its rows from ``first_row`` on go back (a plan never launched,
        or one whose reading was cut there)."""
        for row in [r for r in plan.snapshots if r >= first_row]:
            self.cache.drop_reserved(plan.snapshots.pop(row)[1])

    # ---- release ----------------------------------------------------------------------------------------------
    def on_release(self, req: Req, own: torch.Tensor) -> tuple[bool, torch.Tensor]:
        """A request ends (or is preempted) holding ``own`` KV locations (positions prefix_len on). Where it stops
        is where its conversation's next turn resumes: its computed tokens go into the tree and its state slot
        becomes their snapshot (where decoding computes the state as the model's prefill would: else only its
        prompt's snapshots stay, and the next turn computes the reply again). Returns whether the slot went to the
        tree and the locations the caller still frees."""
        if (req.use_prefix_cache and req.state_slot > 0 and req.state_len > req.prefix_len
                and (self.cache.decoded_states or not req.decoded_state)):
            return self._cache_computed(req, own)
        if req.cache_node is not None and req.cache_node.end > req.prefix_len:
            return False, self._not_in_tree(req, own, req.known_tokens(req.cache_node.end))  # keep what we gave
        return False, own

    def _cache_computed(self, req: Req, own: torch.Tensor) -> tuple[bool, torch.Tensor]:
        n = req.state_len
        tokens = req.known_tokens(n + 1)
        if len(tokens) < n:  # not every computed token is known to the host: nothing exact to keep
            node = req.cache_node
            return False, own if node is None else self._not_in_tree(req, own, req.known_tokens(node.end))
        node, _ = self.cache.insert(tokens[:n], own, req.prefix_len, tokens[n] if len(tokens) > n else -1)
        kept = self.cache.adopt_snapshot(node, req.state_slot)
        return kept, self._not_in_tree(req, own, tokens[:n])

    def _not_in_tree(self, req: Req, own: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Of the request's own locations (positions prefix_len on), those the tree does not hold for ``tokens``:
        it holds some of ours where we gave them (chunk snapshots, the insert above) and others' where another
        request computed the same tokens first; ours there are duplicates."""
        n = len(tokens)
        mine = own[:n - req.prefix_len]
        tree = self.cache.path_locs(tokens)[req.prefix_len:]
        return torch.cat([mine[mine != tree], own[n - req.prefix_len:]])
