"""The host fallback for what does not compile to a device automaton: context-free grammars (Lark, or GBNF
converted to Lark), matched by llguidance on the host.

A grammar's mask for step N + 1 depends on token N, which the host learns one step late in the overlap loop: a
step with such a row therefore reads the step before it first (a blocking read, counted: ``Engine.host_syncs`` and
``hylo_constraint_host_syncs_total``), feeds the new tokens to each row's matcher, and writes the rows' masks into
the device table (``ConstraintTables.host_masks``) before it launches. Such rows also decode without speculation
(their verify positions would need the drafts' masks, which only the device knows). Every other row in the batch
keeps its device automaton; the cost is the steps' overlap while a grammar request runs.
"""

from __future__ import annotations

import numpy as np

from .schema import first_line
from .spec import Constraint


class _Vocabulary:
    """What llguidance's tokenizer wrapper reads: the tokens' bytes, the special ids, an encoder."""

    def __init__(self, tokenizer, vocab: int, eos: int):
        specials = set(getattr(tokenizer, "special_ids", ()))
        self.tokens = [b"" if i in specials or i >= tokenizer.vocab_size else tokenizer.token_bytes(i)
                       for i in range(vocab)]
        self.special_token_ids = sorted(t for t in specials if t < vocab)
        self.eos_token_id, self.bos_token_id = eos, None
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def llg_tokenizer(tokenizer, vocab: int, eos_ids):
    """llguidance's view of the tokenizer for logits of width ``vocab`` (built once per engine: it walks the whole
    vocabulary)."""
    import llguidance

    eos = sorted(eos_ids)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab, eos[0])),
                                  n_vocab=vocab, eos_token=eos)


class GrammarGaveUp(ValueError):
    """The grammar engine stopped following a request's output: a grammar whose language is empty, or one too
    costly to match (llguidance's item limits). The request's own fault: it alone ends, with a 400."""


class HostGrammar:
    """A checked grammar over one tokenizer (``llg_tokenizer``); ``matcher()`` gives each request its own
    matcher."""

    def __init__(self, constraint: Constraint, lltok, vocab: int):
        import llguidance

        self.constraint, self.vocab, self.lltok = constraint, vocab, lltok
        text = constraint.value
        try:
            if constraint.syntax == "gbnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark

                text = gbnf_to_lark(text)
            self.grammar = llguidance.LLMatcher.grammar_from_lark(text)
            error = llguidance.LLMatcher.validate_grammar(self.grammar, self.lltok)
        except Exception as e:  # noqa: BLE001 - llguidance's converter raises plain Exceptions for bad grammars
            error = first_line(e)
        if error:
            raise ValueError(f"grammar constraint: {first_line(error)}")
        self.matcher().mask()  # a grammar no text matches stops before the first token: refused here (GrammarGaveUp)
        self.compile_seconds = 0.0

    def matcher(self) -> "HostMatcher":
        return HostMatcher(self)


class HostMatcher:
    """One request's grammar state on the host."""

    host = True  # marks a request whose constraint is matched on the host (``Req.automaton``)

    def __init__(self, grammar: HostGrammar):
        import llguidance

        self.grammar = grammar
        # silent: where the matcher stops, the request's error says why (no warning of the client's grammar in the log)
        self._m = llguidance.LLMatcher(grammar.lltok, grammar.grammar, log_level=0)
        self.fed = 0  # output tokens consumed
        self._mask, self._mask_fed = None, -1

    def feed(self, tokens) -> None:
        """The request's output tokens from ``fed`` on (each at most once; a preempted request keeps its matcher,
        as it keeps its output)."""
        new = list(tokens[self.fed:])
        if new and not self._m.consume_tokens(new):
            raise self._gave_up(self.fed + len(new))
        self.fed += len(new)

    def mask(self) -> np.ndarray:
        """The allowed tokens after what was fed, as int32 bitmask words (the end-of-sequence tokens where the
        grammar may end); computed once per fed count. Raises ``GrammarGaveUp`` where the matcher stopped (an
        empty language, a grammar past its limits)."""
        if self._mask is None or self._mask_fed != self.fed:
            words = (self.grammar.vocab + 31) // 32
            out = np.zeros(words, dtype=np.int32)
            self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            if self._m.is_error():
                raise self._gave_up(self.fed)
            self._mask, self._mask_fed = out, self.fed
        return self._mask

    def _gave_up(self, tokens: int) -> GrammarGaveUp:
        where = ("before the first output token (no text matches it, or it is too costly to follow)" if not tokens
                 else f"after {tokens} output token{'s' if tokens > 1 else ''} (a grammar with no finite match, or "
                 "too costly to follow)")
        return GrammarGaveUp(f"grammar constraint: the grammar engine stopped {where}: "
                             f"{first_line(self._m.get_error())}")


def grammars_given_up(reqs) -> list:
    """Feed each unfinished host-matched request its new output tokens and compute its next mask, before the step
    is planned: (request, ``GrammarGaveUp``) for those whose grammar the matcher gave up on, which the engine ends
    alone, where an error inside the step's launch would fail every row of it. ``write_host_masks`` then finds the
    others' masks computed."""
    given_up = []
    for req in reqs:
        if req.host_matched and not req.finished:
            try:
                req.automaton.feed(req.output_ids)
                req.automaton.mask()
            except GrammarGaveUp as e:
                given_up.append((req, e))
    return given_up


def write_host_masks(reqs, tables) -> None:
    """Feed each host-matched request's new output tokens to its matcher and write its mask into the device table
    (``ConstraintTables.host_masks``) for the step about to launch."""
    masks = []
    for r in reqs:
        r.automaton.feed(r.output_ids)
        masks.append(r.automaton.mask())
    tables.set_host_masks([r.req_slot for r in reqs], masks)
