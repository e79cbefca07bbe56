"""Hybrid prefix caching: a radix tree over token ids whose nodes hold KV locations (shared by reference with the
requests that use them) and, at some nodes, a snapshot of every linear layer's state (conv window and recurrent
state) exactly after the node's last token.

Attention layers can reuse any cached prefix; a linear layer can only resume from a state kept at exactly that
position. So a hit is the longest cached prefix of a prompt that ends at a snapshot: its KV locations are shared
(never copied), the snapshot is copied into the request's own state slot, and prefill resumes from there.
Snapshots are kept where the next request most likely resumes: where a request stops (its whole computed
conversation: the next turn starts with it), at the end of each prompt, and every ``interval`` tokens of a long
prefill. A snapshot is a state slot of the state pool (the request's own slot, handed over when it finishes, or a
copy made after the prefill chunk that produced it).

Everything here is host bookkeeping: the device work it implies (state copies) is queued by the engine, so the
overlap loop stays free of blocking syncs. Lifetimes follow the engine's rules: a request holds a lock on the node
its shared prefix ends at, so nothing it reads is evicted; eviction takes the least recently used unlocked leaves
(KV) and snapshots, and a freed location or slot is reused only by work queued after everything queued before it,
on the same stream. The recency clock is a counter, not wall time, so tensor-parallel ranks, which make the same
calls, build the same tree.

With MTP speculation, the MTP head's KV at a position is computed from the token that follows it (the head's input
is the pair (hidden at j, token j + 1)). So each node records the token that followed its last position in the
sequence whose KV the tree holds there (``Node.kv_next``), and a hit ending at a snapshot is taken only when the new
prompt has that same token next: the drafts (and a seeded sampled output) are exactly those without the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_pool import KVPool
from .state_pool import StatePool


@dataclass(eq=False)
class Node:
    """An edge of the tree: ``tokens`` after the parent's end, with their KV ``locs``; ``snapshot`` the state slot
    holding the state after the last of them (-1: none)."""

    tokens: list[int]
    locs: torch.Tensor  # host int64 [len(tokens)]
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    lock: int = 0  # requests whose shared prefix ends here or below
    last_use: int = 0
    snapshot: int = -1
    kv_next: int = -1  # the token that followed the last position when its KV was computed (-1: not known)
    end: int = 0  # tokens from the root to this node's end


@dataclass
class Hit:
    length: int  # tokens reused
    node: Node  # the node the prefix ends at (lock it)
    locs: torch.Tensor  # host int64 [length]: the prefix's KV locations
    snapshot: int  # the state slot to copy into the request's slot


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, reused from the cache
    resumed_tokens: int = 0  # tokens a preempted request reused from the cache when it was readmitted
    kv_evicted: int = 0  # KV locations given back by eviction
    snapshots_evicted: int = 0
    snapshots_made: int = 0


class PrefixCache:
    def __init__(self, kv_pool: KVPool, state_pool: StatePool, max_snapshots: int, match_next_token: bool = False,
                 poison: bool = False, decoded_states: bool = True):
        """``max_snapshots``: state slots the cache may hold (the state pool has that many beyond the live
        requests'); ``match_next_token``: the MTP rule above; ``poison``: fill what eviction frees with NaN (tests:
        anything that still read it would show); ``decoded_states``: whether a state that decoding produced may be
        kept (not where the model's prefill computes the same tokens differently: ``decode_matches_prefill``)."""
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.max_snapshots = max_snapshots
        self.match_next_token = match_next_token
        self.poison = poison
        self.decoded_states = decoded_states
        self.root = Node([], torch.empty(0, dtype=torch.int64))
        self.root.lock = 1  # never evicted
        self.stats = CacheStats()
        self.num_snapshots = 0
        self.kv_tokens = 0  # locations the tree holds
        self.evictable_kv = 0  # of those, in unlocked nodes: what eviction could give back now
        self._clock = 0

    # ---- looking up -----------------------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, tokens: list[int]) -> Hit | None:
        """The longest cached prefix of ``tokens`` that ends at a usable snapshot and leaves at least one token to
        compute (the last one's logits are what the request samples from)."""
        node, at, best = self.root, 0, None
        path: list[Node] = []
        limit = len(tokens) - 1
        now = self._tick()
        while at < limit:
            child = node.children.get(tokens[at])
            if child is None or at + len(child.tokens) > limit or tokens[at:at + len(child.tokens)] != child.tokens:
                break
            node, at = child, at + len(child.tokens)
            path.append(node)
            if node.snapshot >= 0 and (not self.match_next_token or node.kv_next == tokens[at]):
                best = node
        if best is None:
            return None
        for n in path:
            n.last_use = now
            if n is best:
                break
        locs = torch.cat([n.locs for n in self._path(best)])
        return Hit(best.end, best, locs, best.snapshot)

    @staticmethod
    def _path(node: Node) -> list[Node]:
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock == 0:
                self.evictable_kv -= len(node.tokens)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock -= 1
            assert node.lock >= 0, "prefix cache: unlocked more than locked"
            if node.lock == 0:
                self.evictable_kv += len(node.tokens)
            node = node.parent

    # ---- adding -----------------------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], own_locs: torch.Tensor, own_start: int,
               next_token: int = -1) -> tuple[Node, int]:
        """Add ``tokens`` to the tree. Positions below ``own_start`` must be cached already (the caller's locked
        prefix); ``own_locs`` are the caller's KV locations of positions ``own_start ..``; ``next_token`` the token
        that followed them in the caller's sequence. Returns the node that ends at ``len(tokens)`` and how many
        leading positions the tree already held (from there on the caller's locations now belong to the tree;
        below it they are duplicates the caller keeps or frees)."""
        node, at, now = self.root, 0, self._tick()
        while at < len(tokens):
            node.last_use = now
            child = node.children.get(tokens[at])
            if child is None:
                break
            common = _common_prefix(child.tokens, tokens[at:])
            if common < len(child.tokens):
                child = self._split(child, common)
            node, at = child, at + common
        held = at
        if held < own_start:
            raise AssertionError(f"prefix cache: inserting from {own_start} but the tree holds only {held}")
        node.last_use = now
        if at < len(tokens):
            new = Node(list(tokens[at:]), own_locs[at - own_start:len(tokens) - own_start].clone(), parent=node,
                       last_use=now, kv_next=next_token, end=len(tokens))
            node.children[tokens[at]] = new
            self.kv_tokens += len(new.tokens)
            self.evictable_kv += len(new.tokens)
            node = new
        return node, held

    def path_locs(self, tokens: list[int]) -> torch.Tensor:
        """The KV locations the tree holds for ``tokens`` (all of which it must hold)."""
        node, at, parts = self.root, 0, []
        while at < len(tokens):
            child = node.children[tokens[at]]
            take = min(len(child.tokens), len(tokens) - at)
            parts.append(child.locs[:take])
            node, at = child, at + take
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def held(self, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` the tree holds (changes nothing)."""
        node, at = self.root, 0
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                break
            common = _common_prefix(child.tokens, tokens[at:])
            at += common
            if common < len(child.tokens):
                break
            node = child
        return at

    def _split(self, child: Node, keep: int) -> Node:
        """Cut ``child``'s edge after ``keep`` tokens; returns the new upper node (ending at the cut)."""
        # the owner of these locations went on with the lower part's first token
        upper = Node(child.tokens[:keep], child.locs[:keep], parent=child.parent, lock=child.lock,
                     last_use=child.last_use, kv_next=child.tokens[keep], end=child.end - len(child.tokens) + keep)
        upper.children[child.tokens[keep]] = child
        child.parent.children[child.tokens[0]] = upper
        child.tokens, child.locs, child.parent = child.tokens[keep:], child.locs[keep:], upper
        return upper

    def reserve_snapshot(self) -> int | None:
        """A state slot for a new snapshot (a copy of a running request's state, added to the tree later with
        ``add_snapshot`` or given back with ``drop_reserved``), evicting the least recently used snapshot when the
        cache holds its share already; None if none can be had. Reserved slots count against the share, so the
        live requests' slots are never taken."""
        while self.num_snapshots >= self.max_snapshots:
            if self.max_snapshots == 0 or not self.evict_snapshot():
                return None
        slot = self.state_pool.alloc(zero=False)
        if slot is not None:
            self.num_snapshots += 1
        return slot

    def drop_reserved(self, slot: int) -> None:
        self.num_snapshots -= 1
        self.state_pool.free(slot)

    def add_snapshot(self, node: Node, slot: int) -> bool:
        """Make the reserved slot ``slot`` (holding the state after ``node``'s last token) the node's snapshot.
        False if the node has one already: the caller drops its reservation."""
        if node.snapshot >= 0 or node is self.root:
            return False
        node.snapshot = slot
        self.stats.snapshots_made += 1
        return True

    def adopt_snapshot(self, node: Node, slot: int) -> bool:
        """Hand a finished request's own state slot to ``node`` as its snapshot (no copy). False if the node has one
        already or no room can be made: the caller frees its slot."""
        if node.snapshot >= 0 or node is self.root or self.max_snapshots == 0:
            return False
        self.lock(node)  # making room must not take the node itself out (it may be a fresh split above the
        try:  # snapshot evicted: the walk up from that one would remove it)
            while self.num_snapshots >= self.max_snapshots:
                if not self.evict_snapshot():
                    return False
        finally:
            self.unlock(node)
        self.num_snapshots += 1
        node.snapshot = slot
        self.stats.snapshots_made += 1
        return True

    # ---- eviction -----------------------------------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def evict_kv(self, need: int) -> int:
        """Free the KV of least recently used unlocked leaves until ``need`` locations came back (or nothing is
        left to evict). Returns how many came back."""
        freed = 0
        while freed < need:
            leaves = [n for n in self._nodes() if not n.children and n.lock == 0]
            if not leaves:
                break
            freed += self._remove(min(leaves, key=lambda n: n.last_use))
        return freed

    def evict_snapshot(self) -> bool:
        """Give back the least recently used snapshot's state slot; a leaf left without one goes too (no hit can
        end there). False if there is none."""
        held = [n for n in self._nodes() if n.snapshot >= 0]
        if not held:
            return False
        node = min(held, key=lambda n: n.last_use)
        self._drop_snapshot(node)
        while node is not self.root and not node.children and node.snapshot < 0 and node.lock == 0:
            parent = node.parent
            self._remove(node)
            node = parent
        return True

    def _drop_snapshot(self, node: Node) -> None:
        if self.poison:
            self.state_pool.poison(node.snapshot)
        self.state_pool.free(node.snapshot)
        node.snapshot = -1
        self.num_snapshots -= 1
        self.stats.snapshots_evicted += 1

    def _remove(self, node: Node) -> int:
        """Take an unlocked leaf out of the tree, giving back its KV and snapshot."""
        assert not node.children and node.lock == 0
        if node.snapshot >= 0:
            self._drop_snapshot(node)
        del node.parent.children[node.tokens[0]]
        if self.poison:
            self.kv_pool.poison(node.locs)
        self.kv_pool.free(node.locs)
        self.kv_tokens -= len(node.tokens)
        self.evictable_kv -= len(node.tokens)
        self.stats.kv_evicted += len(node.tokens)
        return len(node.tokens)

    def clear(self) -> None:
        """Give everything back (requires that no request holds a lock)."""
        while self.root.children:
            if not self.evict_kv(self.kv_tokens):
                raise AssertionError("prefix cache: clear() while requests hold cached prefixes")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
