"""What a constrained request asks for, checked when it arrives, and the one regular expression it compiles to.

Every constraint but a grammar is regular: a regular expression (in the Rust ``regex`` crate's syntax, which
outlines-core compiles), a choice among strings (their alternation), a JSON schema or any JSON object (outlines-core's
schema to regex translation: compact JSON with at most one space between tokens). A grammar (Lark or GBNF) is
matched on the host instead (``constrain.host``). A JSON schema that translation would not enforce (a keyword such
as ``minimum`` or ``not``, a recursive reference, keywords it would drop: ``constrain.schema``) is refused by name
rather than loosened: the output of a constrained request always validates against what it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .schema import prepare_schema, schema_regex

# the Rust regex crate's meta characters: escaped in the strings of a choice
_META = set("\\.+*?()|[]{}^$#&-~")


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint; ``value`` is the regular expression, the schema's JSON text, the choices or
    the grammar's text. Build it with the class methods, which check it and raise ``ValueError`` naming the problem."""

    kind: str
    value: str | tuple[str, ...] | None = None
    syntax: str | None = None  # a grammar's: "lark" or "gbnf"

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"regex constraint: a non-empty string is needed, got {pattern!r}")
        check_regex_size(pattern, "regex")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices) -> "Constraint":
        if (not isinstance(choices, (list, tuple)) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise ValueError(f"choice constraint: a non-empty list of non-empty strings is needed, got {choices!r}")
        return cls("choice", tuple(choices))

    @classmethod
    def grammar(cls, text: str, syntax: str | None = None) -> "Constraint":
        """A context-free grammar in Lark's syntax (``start`` is the start rule) or GBNF (``root ::= ...``; told
        apart by ``::=`` when ``syntax`` is not given). Matched on the host (``constrain.host``), not on the
        device."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"grammar constraint: a non-empty string is needed, got {text!r}")
        syntax = syntax or ("gbnf" if "::=" in text else "lark")
        if syntax not in ("lark", "gbnf"):
            raise ValueError(f"grammar constraint: syntax {syntax!r} is not supported (lark, gbnf)")
        return cls("grammar", text, syntax)

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema constraint: the schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema constraint: the schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(prepare_schema(schema)))  # property order is output order: kept

    def to_regex(self) -> str:
        """The regular expression whose full matches are exactly the allowed outputs."""
        if self.kind == "regex":
            return self.value
        if self.kind == "choice":
            return "(" + "|".join(escape(c) for c in self.value) + ")"
        if self.kind == "json_object":
            return json_object_regex(JSON_OBJECT_DEPTH)
        if self.kind == "grammar":
            raise ValueError("a grammar constraint has no regular expression: it is matched on the host")
        regex = schema_regex(json.loads(self.value))
        check_regex_size(regex, "json_schema")
        return regex


# The most positions a constraint's regular expression may expand to, its counted repetitions multiplied out
# (``a{1000}`` is 1000). The automaton's states, and so its compile time and memory, grow with them: ``a{10000}``
# took 1.5 s against the embedded model's 4096 tokens and ``a{100000}`` minutes and gigabytes, in a thread that
# cannot be stopped once started. 4096 leaves room for any realistic field (a JSON string of maxLength 4000).
# (The compile runs in a child process with a time and memory limit too, ``automaton.compile_automaton``: this
# bound refuses the plainly large at once, the limits what no size bound sees, such as nested loops.)
MAX_REGEX_POSITIONS = 4096


def check_regex_size(pattern: str, kind: str) -> None:
    """Refuse (``ValueError``) an expression that expands to more than ``MAX_REGEX_POSITIONS`` positions."""
    size = regex_positions(pattern)
    if size > MAX_REGEX_POSITIONS:
        what = "regular expression" if kind == "regex" else "schema's regular expression"
        raise ValueError(f"{kind} constraint: its {what} expands to {'more than ' if size >= _CAP else ''}"
                         f"{min(size, _CAP)} positions with its counted repetitions ({{n}}, {{n,m}}) multiplied "
                         f"out, more than the {MAX_REGEX_POSITIONS} hylo compiles; use smaller counts (a "
                         f"maxLength or maxItems, say)")


_CAP = 10 ** 12  # sizes stop growing here: the check only needs to know they are too large


def regex_positions(pattern: str) -> int:
    """An upper bound on the positions (literals, classes, escapes) of ``pattern`` with every counted repetition
    multiplied out; alternatives are added, not maxed, and ``*`` / ``+`` / ``?`` count once. A scan of the Rust
    ``regex`` crate's syntax that needs no full parse: escapes (``\\p{..}``, ``\\x{..}`` among them), character
    classes (nested, with escapes) and groups are skipped over as one position or their content's sum."""
    frames = [[0, 0]]  # per open group: [sum of its positions so far, size of its last atom]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        atom = None
        if c == "\\":
            j = i + 2
            if i + 1 < n and pattern[i + 1] in "pPxuU" and j < n and pattern[j] == "{":
                j = pattern.find("}", j) + 1 or n
            i, atom = j, 1
        elif c == "[":
            j, depth = i + 1, 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":  # a leading ] is a literal
                j += 1
            while j < n and depth:
                if pattern[j] == "\\":
                    j += 1
                elif pattern[j] == "[":
                    depth += 1
                elif pattern[j] == "]":
                    depth -= 1
                j += 1
            i, atom = j, 1
        elif c == "(":
            frames.append([0, 0])
            i += 1
        elif c == ")" and len(frames) > 1:
            atom = frames.pop()[0]
            i += 1
        elif c == "{":
            close = pattern.find("}", i)
            counts = pattern[i + 1:close].split(",") if close > 0 else []
            if 1 <= len(counts) <= 2 and counts[0].strip().isdigit() and all(
                    x.strip().isdigit() or (k == 1 and not x.strip()) for k, x in enumerate(counts)):
                # copies written out: {n} and {n,m} at most m; {n,} n and one starred copy (so {0,} is *)
                times = int(counts[0]) + 1 if len(counts) == 2 and not counts[1].strip() else \
                    max(1, *(int(x) for x in counts))
                frame = frames[-1]
                frame[0] = min(frame[0] + frame[1] * (times - 1), _CAP)
                frame[1] = min(frame[1] * times, _CAP)
                i = close + 1
            else:
                i, atom = i + 1, 1
        elif c in "*+?|^$":
            i += 1
        else:
            i, atom = i + 1, 1
        if atom is not None:
            frame = frames[-1]
            frame[0], frame[1] = min(frame[0] + atom, _CAP), atom
    return sum(f[0] for f in frames)


# ``json_object``: any JSON object whose values nest at most this deep (objects or arrays of plain values, at 2).
# A regular language cannot count brackets, so the depth is bounded; each level multiplies the automaton's states
# by about four, and compiling them against a 150k vocabulary takes seconds per level (measured: 449 states at
# depth 2, 1825 at 3, 7330 at 4)
JSON_OBJECT_DEPTH = 2
_WS = "[ ]?"
_STRING = r'"([^"\\\x00-\x1F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"


def json_object_regex(depth: int) -> str:
    """A JSON object (compact: at most one space between tokens) whose values nest at most ``depth`` deep."""
    def value(d: int) -> str:
        plain = f"{_STRING}|{_NUMBER}|true|false|null"
        return f"({plain})" if d == 0 else f"({plain}|{obj(d - 1)}|{array(d - 1)})"

    def obj(d: int) -> str:
        member = f"{_STRING}{_WS}:{_WS}{value(d)}"
        return rf"\{{{_WS}({member}({_WS},{_WS}{member})*)?{_WS}\}}"

    def array(d: int) -> str:
        return rf"\[{_WS}({value(d)}({_WS},{_WS}{value(d)})*)?{_WS}\]"

    return obj(depth - 1)


def escape(text: str) -> str:
    """``text`` as a regular expression that matches exactly it."""
    return "".join("\\" + c if c in _META else c for c in text)
