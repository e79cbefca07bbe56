"""The device side of constrained decoding: every live automaton in one table, and each request slot's state.

Global states are the automata's states one after another, after state 0, the dead state (reached by a token a
state does not allow: only a verify row's positions after a rejected draft get there, and they are never
committed; it allows every token, so those positions' probabilities stay finite). A request slot's state is -1
when its request has no constraint. A step of constrained rows gathers each row's mask from its state, masks the
logits, and, once the tokens are known, looks up the next states, all on the device: the host never reads a
state, so the overlap loop runs unchanged. The lookup is a binary search over the sorted ``state * V + token`` keys
of every allowed (state, token) pair.

Automata enter the table when a request that uses one starts its prefill (``register``); the table is rebuilt
then, without the automata no slot uses any more, and the slots' states are renumbered on the device (in stream
order after any step already launched, so a step in flight is unaffected).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import to_device
from .automaton import TokenAutomaton

UNCONSTRAINED = -1
HOST = -2  # the row's mask comes from the host (constrain.host), in ``host_masks[slot]``
DEAD = 0


class ConstraintTables:
    def __init__(self, num_slots: int, vocab: int, device: torch.device, eos_ids):
        self.vocab, self.words, self.device = vocab, (vocab + 31) // 32, device
        self.state = torch.full((num_slots + 1,), UNCONSTRAINED, dtype=torch.int64, device=device)
        eos = np.zeros(self.words * 32, dtype=np.uint8)
        eos[[t for t in eos_ids if t < vocab]] = 1
        self._eos_bits = np.packbits(eos, bitorder="little").view(np.int32)
        self._slot_auto: dict[int, TokenAutomaton] = {}
        self._offsets: dict[int, int] = {}  # id(automaton) -> its first global state
        self._order: list[TokenAutomaton] = []
        self.host_masks: torch.Tensor | None = None  # [slots + 1, W], made for the first host-matched request
        self._build([])

    # ---- host side: which automata are in the table --------------------------------------------------------------
    def register(self, slot: int, automaton: TokenAutomaton | None, output_ids=()) -> None:
        """A request's prefill starts in ``slot``: its state becomes its automaton's start, walked over the tokens
        it already emitted (a preempted request), or -1 without a constraint."""
        if automaton is None or getattr(automaton, "host", False):
            self._slot_auto.pop(slot, None)
            self.state[slot] = UNCONSTRAINED if automaton is None else HOST
            return
        self._slot_auto[slot] = automaton
        if id(automaton) not in self._offsets:
            self._build(list({id(a): a for a in self._slot_auto.values()}.values()))
        local = automaton.walk(output_ids)
        self.state[slot] = DEAD if local is None else self._offsets[id(automaton)] + local

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended (after its last step): its automaton no longer keeps a place in the table
        (the next rebuild leaves it out unless another slot uses it; ``register`` sets the slot's next state)."""
        self._slot_auto.pop(slot, None)

    def _build(self, automata: list[TokenAutomaton]) -> None:
        """The device tables of ``automata`` (state 0: dead); the slots' states renumbered into them."""
        old_offsets, old_total = self._offsets, getattr(self, "num_states", 1)
        offsets, total, mask_base = {}, 1, 1
        keys, nexts, masks, mask_of = [], [], [np.full((1, self.words), -1, dtype=np.int32)], [np.zeros(1, np.int32)]
        for a in automata:
            offsets[id(a)] = total
            assert a.vocab == self.vocab, (a.vocab, self.vocab)
            keys.append(a.keys + total * self.vocab)  # (local state + total) * V + token
            nexts.append(a.next_state.astype(np.int64) + total)
            # a final state's mask also allows the end-of-sequence tokens: its own row
            final_rows = np.unique(a.mask_of[a.final])
            extra = a.masks[final_rows] | self._eos_bits
            of = a.mask_of.astype(np.int64) + mask_base
            fin_map = np.full(len(a.masks), -1, dtype=np.int64)
            fin_map[final_rows] = np.arange(len(final_rows)) + mask_base + len(a.masks)
            of[a.final] = fin_map[a.mask_of[a.final]]
            masks += [a.masks, extra]
            mask_of.append(of)
            mask_base += len(a.masks) + len(final_rows)
            total += a.num_states
        dev = self.device
        cat = lambda parts, dt: to_device(torch.from_numpy(np.concatenate(parts).astype(dt)), dev)  # noqa: E731
        self.keys = cat(keys or [np.zeros(0, np.int64)], np.int64)
        self.next_state = cat(nexts or [np.zeros(0, np.int64)], np.int64)
        self.masks = to_device(torch.from_numpy(np.concatenate(masks)), dev)
        self.mask_of = cat(mask_of, np.int64)
        self.num_states = total
        if old_offsets:  # renumber the slots' states: an automaton left out sends its slots to -1
            remap = np.full(old_total, UNCONSTRAINED, dtype=np.int64)
            remap[DEAD] = DEAD
            for a in self._order:
                if id(a) in offsets:
                    o, n = old_offsets[id(a)], offsets[id(a)]
                    remap[o:o + a.num_states] = np.arange(n, n + a.num_states)
            remap_t = to_device(torch.from_numpy(remap), dev)
            self.state.copy_(torch.where(self.state >= 0, remap_t[self.state.clamp(min=0)], self.state))
        self._offsets, self._order = offsets, list(automata)

    def set_host_masks(self, slots: list[int], masks: list) -> None:
        """The host-matched rows' masks for the step about to launch (int32 bitmask words each)."""
        if self.host_masks is None:
            self.host_masks = torch.full((self.state.shape[0], self.words), -1, dtype=torch.int32,
                                         device=self.device)
        rows = torch.from_numpy(np.stack(masks))
        self.host_masks[to_device(torch.tensor(slots), self.device)] = to_device(rows, self.device)

    # ---- device side ---------------------------------------------------------------------------------------------
    def mask_logits(self, logits: torch.Tensor, states: torch.Tensor,
                    slots: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` [R, V] with the tokens each row's state (``states`` [R], -1: none; -2: the host's mask in
        ``host_masks[slots]``) does not allow at -inf."""
        words = self.masks[self.mask_of[states.clamp(min=0)]]  # [R, W]
        if self.host_masks is not None and slots is not None:
            words = torch.where((states == HOST)[:, None], self.host_masks[slots], words)
        bits = (words[:, :, None] >> torch.arange(32, device=words.device, dtype=torch.int32)) & 1
        allowed = bits.view(states.shape[0], -1)[:, :logits.shape[-1]].bool() | (states == UNCONSTRAINED)[:, None]
        return logits.masked_fill(~allowed, float("-inf"))

    def next_states(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The state after ``tokens`` from ``states`` (same shapes): -1 and -2 stay, a token the state does not
        allow leads to the dead state."""
        query = states.clamp(min=0) * self.vocab + tokens
        n = self.keys.shape[0]
        if n == 0:
            return torch.where(states < 0, states, torch.zeros_like(states))
        i = torch.searchsorted(self.keys, query).clamp(max=n - 1)
        found = (self.keys[i] == query) & (states > DEAD)
        return torch.where(states < 0, states, torch.where(found, self.next_state[i], torch.zeros_like(states)))

    def chain(self, slots: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """A verify row's states [B, k + 1]: its slot's state, then after each of its drafts [B, k] in turn."""
        states = [self.state[slots]]
        for i in range(drafts.shape[1]):
            states.append(self.next_states(states[-1], drafts[:, i]))
        return torch.stack(states, dim=1)

    def advance(self, slots: torch.Tensor, states: torch.Tensor, tokens: torch.Tensor,
                keep: torch.Tensor | None = None) -> None:
        """Slots ``slots`` [B] move to the state after ``tokens`` [B] from ``states`` [B] (rows with ``keep``
        False stay where they are)."""
        new = self.next_states(states, tokens)
        if keep is not None:
            new = torch.where(keep, new, self.state[slots])
        self.state[slots] = new
