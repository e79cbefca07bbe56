"""A constraint's token-level automaton: which tokens each state allows and where each one leads, built from the
constraint's regular expression and the tokenizer's vocabulary (outlines-core's ``Index``: a DFA over bytes walked
with every token's bytes, partial UTF-8 characters included), flattened into arrays for the device tables.

The end of the output is the automaton's business too: a state where the expression may end allows the model's
end-of-sequence tokens (``TokenAutomaton.final``; the device tables add their bits). Special tokens are never
allowed elsewhere. Compiling is the slow part (a second or more at a 150k vocabulary for a JSON schema): it runs
once per (constraint, tokenizer) and is cached (``AutomatonCache``), outside the engine's step loop.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import index_worker
from .index_worker import flatten_index
from .schema import first_line
from .spec import Constraint

if TYPE_CHECKING:
    from .host import HostGrammar

# choices up to this many characters of regular expression compile in-process (a trie of that many states at most:
# milliseconds); longer lists, whose size the client sets, under the child process's limits
IN_PROCESS_CHOICE_CHARS = 4096
# a constraint that failed to compile is refused with the same message for this long without compiling again (its
# failure may have been a time limit passed under load, so not for good)
FAILED_TTL_S = 600.0
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


def _env_number(var: str, default: float, minimum: float) -> float:
    text = os.environ.get(var)
    try:
        value = float(text) if text is not None else default
    except ValueError:
        value = None
    if value is None or not minimum <= value < float("inf"):
        raise ValueError(f"{var}={text!r}: expected a number of at least {minimum:g}")
    return value


# Limits of one compile in its child process (``index_worker``): past them the constraint is refused, and nothing
# else is harmed. A four-field JSON schema takes about a second at a 150k vocabulary; the cap on the child's address
# space leaves room for the largest automata the device tables accept. Read from the environment when the first
# constraint compiles (a malformed value is that request's error, naming the variable).
COMPILE_TIMEOUT_S: float | None = None
COMPILE_MEMORY_BYTES: int | None = None


def _limits() -> tuple[float, int]:
    global COMPILE_TIMEOUT_S, COMPILE_MEMORY_BYTES
    if COMPILE_TIMEOUT_S is None:
        COMPILE_TIMEOUT_S = _env_number("HYLO_CONSTRAINT_COMPILE_TIMEOUT_S", 60, 1)
    if COMPILE_MEMORY_BYTES is None:  # below about 1 GiB the child cannot even load its libraries
        COMPILE_MEMORY_BYTES = int(_env_number("HYLO_CONSTRAINT_COMPILE_MEMORY_GB", 8, 1) * 2 ** 30)
    return COMPILE_TIMEOUT_S, COMPILE_MEMORY_BYTES


def compile_automaton(constraint: Constraint, vocabulary: dict[bytes, list[int]], vocab: int) -> TokenAutomaton:
    """The constraint's automaton over ``vocabulary`` (``vocabulary_bytes``) for logits of width ``vocab``.
    Raises ValueError naming the problem: an expression the regex engine refuses, one that allows no output, one
    too large for the device, or one whose compile passes its time or memory limit. A given regular expression, a
    schema's and a long list of choices compile in a child process (``index_worker``); ``json_object`` and a few
    short choices, whose sizes are small and known, in this one."""
    start = time.perf_counter()
    regex = constraint.to_regex()
    try:
        if constraint.kind == "json_object" or constraint.kind == "choice" and len(regex) <= IN_PROCESS_CHOICE_CHARS:
            arrays = flatten_index(regex, vocab, vocabulary)
        else:
            arrays = _compile_in_child(constraint, regex, vocab, vocabulary)
    except _OverLimit as e:
        raise ValueError(f"{constraint.kind} constraint: {e}") from None
    except ValueError as e:
        raise ValueError(f"{constraint.kind} constraint: cannot be compiled ({first_line(e)})") from None
    if arrays["masks"].nbytes > MAX_MASK_BYTES:
        raise ValueError(f"{constraint.kind} constraint: its automaton needs {len(arrays['masks'])} distinct token "
                         f"masks ({arrays['masks'].nbytes >> 20} MiB), more than the {MAX_MASK_BYTES >> 20} MiB "
                         f"allowed; simplify it")
    if not arrays["final"].any() and not len(arrays["keys"]):
        raise ValueError(f"{constraint.kind} constraint: no output of this vocabulary can match it")
    return TokenAutomaton(constraint, vocab, compile_seconds=time.perf_counter() - start, **arrays)


# How many child compiles run at once (each may take its whole memory cap): others wait their turn, so that a burst
# of explosive constraints costs time, not the machine's memory
_CHILD_COMPILES = threading.BoundedSemaphore(2)


def _compile_in_child(constraint: Constraint, regex: str, vocab: int, vocabulary: dict[bytes, list[int]]) -> dict:
    with _CHILD_COMPILES:
        return _run_child(regex, vocab, vocabulary)


def _run_child(regex: str, vocab: int, vocabulary: dict[bytes, list[int]]) -> dict:
    timeout_s, memory_bytes = _limits()
    job = pickle.dumps(dict(regex=regex, vocab=vocab, vocabulary=vocabulary, memory_bytes=memory_bytes),
                       protocol=pickle.HIGHEST_PROTOCOL)
    script = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
    try:
        run = subprocess.run([sys.executable, "-c", script, index_worker.__file__], input=job,
                             capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise _OverLimit(f"its automaton did not compile within {timeout_s:.0f} s; simplify it (fewer "
                         f"nested repetitions or arrays)") from None
    if run.returncode == 0 and run.stdout:
        result = pickle.loads(run.stdout)
        if "ok" in result:
            return result["ok"]
        if "error" in result:
            raise ValueError(result["error"])
    # out of memory: a MemoryError reported, an abort from a failed allocation (SIGABRT), or the kernel's kill
    elif run.returncode not in (0, -6, -9, 134, 137) and b"memory" not in run.stderr.lower():  # not the cap: a fault
        raise RuntimeError(f"the constraint compiler's process failed (exit code {run.returncode}): "
                           f"{run.stderr.decode(errors='replace').strip()[-500:]}")
    raise _OverLimit(f"its automaton needs more than {memory_bytes / 2 ** 30:.3g} GiB to compile; "
                     f"simplify it (fewer nested repetitions or arrays)")


class _OverLimit(ValueError):
    """A compile stopped at its time or memory limit."""


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
        self._failed: OrderedDict[Constraint, tuple[str, float]] = OrderedDict()  # message, when
        self.compiles = 0
        self.compile_seconds = 0.0

    def get(self, constraint: Constraint) -> "TokenAutomaton | HostGrammar":
        with self._lock:
            hit = self._known(constraint)
            if hit is not None:
                return hit
            gate = self._pending.setdefault(constraint, threading.Lock())
        with gate:  # one compile per constraint: the other callers wait here, then find its result
            with self._lock:
                hit = self._known(constraint)
                if hit is not None:
                    return hit
            try:
                auto = self._compile(constraint)
            except BaseException as e:
                with self._lock:
                    self._pending.pop(constraint, None)
                    if isinstance(e, ValueError):  # the constraint's own fault: the waiters get it at once
                        self._failed[constraint] = (str(e), time.monotonic())
                        while len(self._failed) > self.capacity:
                            self._failed.popitem(last=False)
                raise
            with self._lock:  # (in the lock that retires the gate: a new caller finds the result)
                self._pending.pop(constraint, None)
                self._done[constraint] = auto
                self.compiles += 1
                self.compile_seconds += auto.compile_seconds
                while len(self._done) > self.capacity:
                    self._done.popitem(last=False)
            return auto

    def _known(self, constraint: Constraint):
        """(Under the lock.) The compiled constraint, None if there is none yet; raises the ValueError of a compile
        that failed within ``FAILED_TTL_S`` (a request that keeps sending it is not compiled again and again)."""
        if constraint in self._done:
            self._done.move_to_end(constraint)
            return self._done[constraint]
        failed = self._failed.get(constraint)
        if failed is not None:
            if time.monotonic() - failed[1] < FAILED_TTL_S:
                raise ValueError(failed[0])
            del self._failed[constraint]
        return None

    def _compile(self, constraint: Constraint) -> "TokenAutomaton | HostGrammar":
        if constraint.kind == "grammar":  # no device automaton: matched on the host (constrain.host)
            from .host import HostGrammar, llg_tokenizer

            start = time.perf_counter()
            if self._lltok is None:
                self._lltok = llg_tokenizer(self.tokenizer, self.vocab, self.eos_ids)
            auto = HostGrammar(constraint, self._lltok, self.vocab)
            auto.compile_seconds = time.perf_counter() - start
            return auto
        if self._vocabulary is None:
            self._vocabulary = vocabulary_bytes(self.tokenizer, self.vocab)
        return compile_automaton(constraint, self._vocabulary, self.vocab)
