"""A request's output constraint, from the fields OpenAI's and vLLM's APIs carry it in:

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (OpenAI);
- ``structured_outputs``: ``{"json": schema}``, ``{"regex": "..."}``, ``{"choice": [...]}``,
  ``{"json_object": true}``, ``{"grammar": "..."}`` (vLLM; a grammar, Lark or GBNF, is matched on the host, at the
  cost of a blocking read per step while it runs: ``constrain.host``);
- ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM's older names).
At most one of them per request. Every problem is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from ..constrain.spec import Constraint
from .protocol import APIError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = {"json", "regex", "choice", "json_object", "grammar", "structural_tag"}
# vLLM's options of the JSON translation, and the values that mean "as hylo does anyway"
_NEUTRAL_OPTIONS = {"disable_any_whitespace": (None, False), "disable_additional_properties": (None, False),
                    "whitespace_pattern": (None,)}


def constraint_of(body) -> tuple[str | None, Constraint | None]:
    """The constraint a completions or chat request asks for, checked (not yet compiled), and the field it came
    in; (None, None) without one."""
    found: list[tuple[str, Constraint]] = []
    rf = body.response_format
    if rf is not None:
        c = _response_format(rf)
        if c is not None:
            found.append(("response_format", c))
    so = body.structured_outputs
    if so is not None:
        found.append(("structured_outputs", _structured_outputs(so)))
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((name, _build(kind, value, name)))
    if len(found) > 1:
        raise APIError(f"give one output constraint, not {len(found)} ({', '.join(n for n, _ in found)})",
                       param=found[1][0])
    return found[0] if found else (None, None)


# The threads constraint compiles wait and run in: their own, so that a burst of slow compiles (each up to its
# time limit) never takes the shared pool's threads that encode every request's prompt
_COMPILE_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hylo-constraint")


async def compile_constraint(engine, constraint: Constraint | None, param: str | None) -> None:
    """Compile the request's constraint now, in a worker thread of its own pool (seconds at a large vocabulary, the
    first time a constraint is seen; cached after): the engine thread then finds it compiled, and a constraint that
    cannot be compiled is a 400 naming the field."""
    if constraint is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(_COMPILE_THREADS, engine.compile_constraint, constraint)
    except ValueError as e:
        raise APIError(f"{param}: {e}", param=param) from None


def _response_format(rf: dict) -> Constraint | None:
    if not isinstance(rf, dict):
        raise APIError("response_format must be an object", param="response_format")
    kind = rf.get("type")
    if kind is None:
        raise APIError("response_format needs a type (text, json_object or json_schema)", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise APIError("response_format json_schema needs json_schema.schema (the JSON schema)",
                           param="response_format")
        return _build("json", spec.get("schema", spec.get("json_schema")), "response_format")
    raise APIError(f"response_format type {kind!r} is not supported (text, json_object, json_schema are)",
                   param="response_format", code="unsupported_parameter")


def _structured_outputs(so: dict) -> Constraint:
    if not isinstance(so, dict):
        raise APIError("structured_outputs must be an object", param="structured_outputs")
    given = [k for k, v in so.items() if k in _STRUCTURED_KEYS and v not in (None, False)]
    unknown = [k for k in so if k not in _STRUCTURED_KEYS and k not in _NEUTRAL_OPTIONS]
    if unknown:
        raise APIError(f"structured_outputs: unknown field {unknown[0]!r}", param="structured_outputs")
    changed = [k for k, neutral in _NEUTRAL_OPTIONS.items() if k in so and so[k] not in neutral]
    if changed:  # accepted at their neutral values only: hylo's JSON whitespace and object keys are its own
        raise APIError(f"structured_outputs.{changed[0]} is not supported by hylo (JSON output has at most one space "
                       f"between tokens)", param="structured_outputs", code="unsupported_parameter")
    if len(given) != 1:
        raise APIError(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object (got "
                       f"{given or 'none'})", param="structured_outputs")
    kind = given[0]
    if kind == "structural_tag":
        raise APIError("structured_outputs.structural_tag is not supported by hylo (json, regex, choice, grammar and "
                       "json_object are)", param="structured_outputs", code="unsupported_parameter")
    if kind == "json_object":
        return Constraint.json_object()
    return _build(kind, so[kind], "structured_outputs")


def _build(kind: str, value, param: str) -> Constraint:
    try:
        if kind == "json":
            return Constraint.json_schema(value)
        if kind == "regex":
            return Constraint.regex(value)
        if kind == "grammar":
            return Constraint.grammar(value)
        return Constraint.choice(value)
    except ValueError as e:
        raise APIError(f"{param}: {e}", param=param) from None
