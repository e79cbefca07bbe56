"""A constraint's token-level automaton: which tokens each state allows and where each one leads, built from the
constraint's regular expression and the tokenizer's vocabulary (outlines-core's ``Index``: a DFA over bytes walked
with every token's bytes, partial UTF-8 characters included), flattened into arrays for the device tables.

The end of the output is the automaton's business too: a state where the expression may end allows the model's
end-of-sequence tokens (``TokenAutomaton.final``; the device tables add their bits). Special tokens are never
allowed elsewhere. Compiling is the slow part (a second or more at a 150k vocabulary for a JSON schema): it runs
once per (constraint, tokenizer) and is cached (``AutomatonCache``), outside the engine's step loop.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .schema import first_line
from .spec import Constraint

if TYPE_CHECKING:
    from .host import HostGrammar

# a constraint whose masks would take more device memory than this is refused (one 32-bit word per 32 tokens per
# distinct mask; JSON schemas share most of theirs)
MAX_MASK_BYTES = 256 << 20


@dataclass
class TokenAutomaton:
    """States 0..S-1, ``initial`` the start. ``keys`` (sorted, int64) are ``state * vocab + token`` of every
    allowed (state, token) and ``next_state`` [T] where that token leads; ``masks`` [M, W] int32 the distinct
    allowed-token bitmasks (bit t % 32 of word t // 32) and ``mask_of`` [S] each state's; ``final`` [S] whether the
    output may end there."""

    constraint: Constraint
    vocab: int
    initial: int
    keys: np.ndarray
    next_state: np.ndarray
    masks: np.ndarray
    mask_of: np.ndarray
    final: np.ndarray
    compile_seconds: float

    @property
    def num_states(self) -> int:
        return len(self.final)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.next_state, self.masks, self.mask_of, self.final))

    def allowed(self, state: int) -> np.ndarray:
        """The token ids state ``state`` allows (end-of-sequence tokens not included), sorted."""
        bits = np.unpackbits(self.masks[self.mask_of[state]].view(np.uint8), bitorder="little")[:self.vocab]
        return np.flatnonzero(bits)

    def step(self, state: int, token: int) -> int | None:
        """The state after ``token``, or None where the state does not allow it."""
        key = state * self.vocab + token
        i = int(np.searchsorted(self.keys, key))
        return int(self.next_state[i]) if i < len(self.keys) and self.keys[i] == key else None

    def walk(self, tokens) -> int | None:
        """The state after ``tokens`` from the start (None: they leave the language)."""
        state = self.initial
        for t in tokens:
            state = self.step(state, t)
            if state is None:
                return None
        return state


def vocabulary_bytes(tokenizer, vocab: int) -> dict[bytes, list[int]]:
    """Each token's bytes -> its ids, for the tokens a constrained output may use: every id below ``vocab`` the
    tokenizer has, except its special tokens (and empty ones)."""
    out: dict[bytes, list[int]] = {}
    specials = getattr(tokenizer, "special_ids", set())
    for i in range(min(vocab, tokenizer.vocab_size)):
        if i in specials:
            continue
        b = tokenizer.token_bytes(i)
        if b:
            out.setdefault(b, []).append(i)
    return out


def compile_automaton(constraint: Constraint, vocabulary: dict[bytes, list[int]], vocab: int) -> TokenAutomaton:
    """The constraint's automaton over ``vocabulary`` (``vocabulary_bytes``) for logits of width ``vocab``.
    Raises ValueError naming the problem: an expression the regex engine refuses, one that allows no output, one
    too large for the device."""
    from outlines_core import Index, Vocabulary

    start = time.perf_counter()
    regex = constraint.to_regex()
    try:
        # the end-of-sequence id outlines wants is one no token has: the device tables allow the model's own
        index = Index(regex, Vocabulary(vocab, vocabulary))
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"{constraint.kind} constraint: cannot be compiled ({first_line(e)})") from None
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    order = {s: i for i, s in enumerate(sorted(set(transitions) | finals | {index.get_initial_state()}))}
    words = (vocab + 31) // 32
    keys, nexts, rows = [], [], []
    for state, local in order.items():
        moves = {t: n for t, n in transitions.get(state, {}).items() if t < vocab}
        tokens = np.fromiter(moves.keys(), dtype=np.int64, count=len(moves))
        targets = np.fromiter((order[n] for n in moves.values()), dtype=np.int32, count=len(moves))
        sort = np.argsort(tokens)
        keys.append(local * vocab + tokens[sort])
        nexts.append(targets[sort])
        bits = np.zeros(words * 32, dtype=np.uint8)
        bits[tokens] = 1
        rows.append(np.packbits(bits, bitorder="little").view(np.int32))
    masks, mask_of = np.unique(np.stack(rows), axis=0, return_inverse=True)
    final = np.zeros(len(order), dtype=bool)
    final[[order[s] for s in finals]] = True
    if masks.nbytes > MAX_MASK_BYTES:
        raise ValueError(f"{constraint.kind} constraint: its automaton needs {len(masks)} distinct token masks "
                         f"({masks.nbytes >> 20} MiB), more than the {MAX_MASK_BYTES >> 20} MiB allowed; simplify it")
    initial = order[index.get_initial_state()]
    if not final.any() and not any(len(k) for k in keys):
        raise ValueError(f"{constraint.kind} constraint: no output of this vocabulary can match it")
    return TokenAutomaton(constraint, vocab, initial, np.concatenate(keys), np.concatenate(nexts),
                          np.ascontiguousarray(masks), mask_of.astype(np.int32).reshape(-1), final,
                          time.perf_counter() - start)


class AutomatonCache:
    """Compiled automata of one tokenizer and logit width, by constraint (least recently used dropped past
    ``capacity``). Safe to call from several threads: a constraint compiles once, other callers wait for it."""

    def __init__(self, tokenizer, vocab: int, capacity: int = 64, eos_ids=()):
        self.tokenizer, self.vocab, self.capacity, self.eos_ids = tokenizer, vocab, capacity, set(eos_ids)
        self._vocabulary: dict[bytes, list[int]] | None = None  # for the automata (outlines-core)
        self._lltok = None  # for the grammars (llguidance's tokenizer over the same vocabulary)
        self._done: OrderedDict[Constraint, TokenAutomaton] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[Constraint, threading.Lock] = {}
        self.compiles = 0
        self.compile_seconds = 0.0

    def get(self, constraint: Constraint) -> "TokenAutomaton | HostGrammar":
        with self._lock:
            if constraint in self._done:
                self._done.move_to_end(constraint)
                return self._done[constraint]
            gate = self._pending.setdefault(constraint, threading.Lock())
        with gate:
            with self._lock:
                if constraint in self._done:
                    return self._done[constraint]
            try:
                if constraint.kind == "grammar":  # no device automaton: matched on the host (constrain.host)
                    from .host import HostGrammar, llg_tokenizer

                    start = time.perf_counter()
                    if self._lltok is None:
                        self._lltok = llg_tokenizer(self.tokenizer, self.vocab, self.eos_ids)
                    auto = HostGrammar(constraint, self._lltok, self.vocab)
                    auto.compile_seconds = time.perf_counter() - start
                else:
                    if self._vocabulary is None:
                        self._vocabulary = vocabulary_bytes(self.tokenizer, self.vocab)
                    auto = compile_automaton(constraint, self._vocabulary, self.vocab)
            finally:
                with self._lock:
                    self._pending.pop(constraint, None)
            with self._lock:
                self._done[constraint] = auto
                self.compiles += 1
                self.compile_seconds += auto.compile_seconds
                while len(self._done) > self.capacity:
                    self._done.popitem(last=False)
            return auto
