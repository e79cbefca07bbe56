"""JSON schemas for constrained decoding: what outlines-core's schema to regex translation enforces, checked (and
``allOf`` merged) before a request is accepted.

The translation reads one family of keywords per schema and drops the rest without a word (``properties`` beside
``anyOf``, ``minLength`` beside ``enum``, a ``$ref`` beside anything), cuts recursion at a depth by dropping the
recursive member and leaving its comma (invalid JSON), and writes property names between quotes unescaped. So a
schema is refused by name where the output could fail to validate against it, rather than loosened:
``prepare_schema`` is the one entry, ``schema_regex`` the translation.
"""

from __future__ import annotations

import json

# keywords whose meaning the translation enforces (or tightens: an object with ``properties`` gets no other keys,
# ``prefixItems`` no items after them), and annotations without a meaning for the output
_ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
             "maxItems", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions", "minLength",
             "maxLength", "pattern", "format", "oneOf"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "discriminator"}
_FORMATS = {"date-time", "date", "time", "uuid", "email", "uri"}
# Patterns hylo writes for formats whose own translation can break the JSON string it sits in: outlines-core's
# "time" has ``\\.`` (a backslash, then any character) for the fraction's dot, its "email" allows a quoted local
# part (raw quotes and control characters) and its "uri" any non-space character (a quote, a backslash). These
# match the same values (ASCII digits only) with nothing a JSON string must escape.
_NO_ESCAPE = r'\s"\\\x00-\x1F\x7F'  # whitespace, quote, backslash, controls: never inside these values
_FORMAT_PATTERNS = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",  # (outlines-core's \d takes any Unicode digit)
    "time": r"(2[0-3]|[01][0-9]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?Z?",
    "email": r"[a-z0-9!#$%&'*+/=?^_`{|}~-]+(\.[a-z0-9!#$%&'*+/=?^_`{|}~-]+)*@([a-z0-9]([a-z0-9-]*[a-z0-9])?\.)+"
             r"[a-z0-9]([a-z0-9-]*[a-z0-9])?",
    "uri": rf"(https?|ftp)://([^{_NO_ESCAPE}:@]+(:[^{_NO_ESCAPE}:@]*)?@)?([a-zA-Z0-9.-]+\.[a-zA-Z]{{2,}}|localhost)"
           rf"(:[0-9]+)?(/[^{_NO_ESCAPE}?#]*)?(\?[^{_NO_ESCAPE}#]*)?(#[^{_NO_ESCAPE}]*)?"
           rf"|urn:[a-zA-Z0-9][a-zA-Z0-9-]{{0,31}}:[^{_NO_ESCAPE}]+",
}
# a string schema's keyword families, of which the translation reads the first present and drops the others
_STRING_FAMILIES = (("minLength", "maxLength"), ("pattern",), ("format",))
_CHILD_MAPS = ("properties", "$defs", "definitions")  # where sub-schemas are: maps of name -> schema,
_CHILD_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # lists of schemas,
_CHILD_ONE = ("items", "additionalProperties")  # one schema
_NOT_CONSTRAINTS = _ANNOTATIONS | {"$defs", "definitions"}
_FALSE_NEUTRAL = {"uniqueItems"}  # refused unless false (their neutral value)
_ZERO_NEUTRAL = {"minProperties"}


def _is_neutral(key: str, value) -> bool:
    """A keyword at the value that asks for nothing (``uniqueItems: false``, ``minProperties: 0``)."""
    return key in _FALSE_NEUTRAL and value is False or key in _ZERO_NEUTRAL and value == 0


def check_schema(schema, where: str = "") -> None:
    """Refuse (``ValueError``, naming the keyword and where it is) what the regex translation cannot enforce."""
    if isinstance(schema, bool):
        if not schema:
            raise ValueError(f"json_schema constraint: the schema at {where or '/'} is false (nothing matches)")
        return
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema constraint: the schema at {where or '/'} must be an object or a boolean")
    _check_values(schema, where)
    for key, value in schema.items():
        at = f"{where}/{key}"
        if key in _ANNOTATIONS:
            continue
        if _is_neutral(key, value):
            continue
        if key not in _ENFORCED:
            raise ValueError(f"json_schema constraint: keyword {key!r} (at {at}) cannot be enforced by hylo's "
                             f"constrained decoding; remove it or check the output after generation")
        if key == "format" and value not in _FORMATS:
            raise ValueError(f"json_schema constraint: format {value!r} (at {at}) is not supported "
                             f"(supported: {', '.join(sorted(_FORMATS))})")
        if key == "oneOf" and not _disjoint_types(value):
            raise ValueError(f"json_schema constraint: oneOf (at {at}) is enforced only when its branches have "
                             f"different types (a value matching two branches would be invalid); use anyOf")
        if key in _CHILD_MAPS:
            if not isinstance(value, dict):
                raise ValueError(f"json_schema constraint: {key} (at {at}) must be an object")
            for name, sub in value.items():
                check_schema(sub, f"{at}/{name}")
        elif key in _CHILD_LISTS:
            if not isinstance(value, list) or not value:
                raise ValueError(f"json_schema constraint: {key} (at {at}) must be a non-empty list")
            for i, sub in enumerate(value):
                check_schema(sub, f"{at}/{i}")
        elif key in _CHILD_ONE and not isinstance(value, bool):
            check_schema(value, at)
    _check_combination(schema, where)


_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")


def _check_values(schema: dict, where: str) -> None:
    """The values the translation would read loosely or not at all: a negative count (read as no bound), an empty
    enum or type list (nothing can match), required names without a schema in ``properties`` (not enforced)."""
    for key in _COUNTS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"json_schema constraint: {key} (at {where}/{key}) must be a non-negative integer, "
                             f"got {value!r}")
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
        if low in schema and high in schema and schema[low] > schema[high]:
            raise ValueError(f"json_schema constraint: {low} {schema[low]} is more than {high} {schema[high]} (at "
                             f"{where or '/'}): nothing can match it")
    for key in ("enum", "type"):
        if key in schema and schema[key] == []:
            raise ValueError(f"json_schema constraint: {key} (at {where}/{key}) is empty: nothing can match it")
    if "required" in schema:
        required, props = schema["required"], schema.get("properties", {})
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"json_schema constraint: required (at {where}/required) must be a list of names")
        missing = [r for r in required if not isinstance(props, dict) or r not in props]
        if missing:
            raise ValueError(f"json_schema constraint: required property {missing[0]!r} (at {where}/required) has "
                             f"no schema in properties, and hylo enforces required properties through theirs")


def _type_names(t) -> set | None:
    """A ``type`` keyword's names as a set (None: neither a name nor a list)."""
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None


def _disjoint_types(branches) -> bool:
    if not isinstance(branches, list):
        return False
    seen = set()
    for b in branches:
        types = _type_names(b.get("type") if isinstance(b, dict) else None)
        if not types:
            return False
        if "number" in types:
            types.add("integer")
        if "integer" in types:
            types.add("number")
        if seen & types:
            return False
        seen |= types
    return True


def _grouped_patterns(schema):
    """A copy of the schema whose ``pattern`` values are one group without anchors: the translation writes a
    pattern between the string's quotes as it is, so a top-level alternation (``a|b``) would escape them. A format
    of ``_FORMAT_PATTERNS`` becomes its pattern (a format stands alone in its schema: ``_check_combination``)."""
    if isinstance(schema, list):
        return [_grouped_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            body = value[1:] if value.startswith("^") else value
            if body.endswith("$") and not body.endswith("\\$"):
                body = body[:-1]
            out[key] = f"({body})"
        elif key == "format" and isinstance(value, str) and value in _FORMAT_PATTERNS:
            out["pattern"] = f"({_FORMAT_PATTERNS[value]})"
        elif key in _CHILD_MAPS and isinstance(value, dict):  # names -> schemas (a property may be named "enum")
            out[key] = {name: _grouped_patterns(sub) for name, sub in value.items()}
        elif key in _CHILD_LISTS or key in _CHILD_ONE:
            out[key] = _grouped_patterns(value)
        else:  # a keyword's value (enum, const, required, ...): data, not schemas
            out[key] = value
    return out


# --- allOf merged into its parent; combinations and recursive references refused ---------------------------------


def prepare_schema(schema, where: str = "") -> dict | bool:
    """The schema as the translation will read it (``allOf`` merged into its parent), after checking that its
    output always validates against the original; ``ValueError`` naming the keyword and where it is otherwise."""
    _check_depth(schema, where)
    merged = _merge_all_of(schema, where)
    check_schema(merged, where)
    _check_refs(merged, where)
    return merged


# The deepest nesting of objects and lists a schema may have (a schema nested 20 objects deep is about 40: each level
# is the schema and its "properties"). The translation walks it recursively; a request of 340 nested objects (20 KB)
# exhausted Python's recursion limit.
MAX_SCHEMA_DEPTH = 64


def _check_depth(schema, where: str) -> None:
    """Refuse a schema nested deeper than ``MAX_SCHEMA_DEPTH`` (walked without recursion)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"json_schema constraint: the schema at {where or '/'} nests objects and lists more "
                             f"than {MAX_SCHEMA_DEPTH} deep; flatten it")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def schema_regex(schema, what: str = "json_schema constraint") -> str:
    """outlines-core's regular expression for a prepared schema (``prepare_schema``)."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return build_regex_from_schema(json.dumps(_grouped_patterns(schema)))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what}: {first_line(e)}") from None


def first_line(e: "Exception | str") -> str:
    """The first line of an error (a compiler's message may run on), or the exception's type when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _subschemas(schema: dict, definitions: bool = True):
    """(keyword, name or index or None, sub-schema) of each schema ``schema`` holds (its definitions' too, where
    ``definitions``)."""
    for key in _CHILD_MAPS:
        if isinstance(schema.get(key), dict) and (definitions or key == "properties"):
            yield from ((key, name, sub) for name, sub in schema[key].items())
    for key in _CHILD_LISTS:
        if isinstance(schema.get(key), list):
            yield from ((key, i, sub) for i, sub in enumerate(schema[key]))
    for key in _CHILD_ONE:
        if isinstance(schema.get(key), dict):
            yield key, None, schema[key]


def _children(schema: dict, fn) -> dict:
    """A copy of ``schema`` with ``fn(sub, key path)`` applied to each of its sub-schemas."""
    out = dict(schema)
    for key in _CHILD_MAPS + _CHILD_LISTS:  # their own copies, so that the caller's schema stays as it was
        if isinstance(out.get(key), (dict, list)):
            out[key] = type(out[key])(out[key])
    for key, at, sub in _subschemas(schema):
        if at is None:
            out[key] = fn(sub, f"/{key}")
        else:
            out[key][at] = fn(sub, f"/{key}/{at}")
    return out


def _merge_all_of(schema, where: str):
    """``schema`` with every ``allOf`` merged into the schema that holds it: properties and definitions joined,
    required names united, types intersected; any other keyword two branches set differently is refused (the
    translation would have concatenated the branches: ``{"a": 1}{"b": 2}``)."""
    if not isinstance(schema, dict):
        return schema
    schema = _children(schema, lambda sub, key: _merge_all_of(sub, where + key))
    branches = schema.pop("allOf", None)
    if not isinstance(branches, list):
        if branches is not None:
            schema["allOf"] = branches  # check_schema names it
        return schema
    at = f"{where}/allOf"
    for i, branch in enumerate(branches):
        if branch is True:
            continue
        if not isinstance(branch, dict):
            raise ValueError(f"json_schema constraint: allOf branch {at}/{i} is {json.dumps(branch)}: "
                             f"{'nothing matches it' if branch is False else 'a schema must be an object'}")
        for key, value in branch.items():
            if key in _ANNOTATIONS:
                schema.setdefault(key, value)
            elif key in _CHILD_MAPS and key in schema:
                if not isinstance(value, dict) or not isinstance(schema[key], dict):
                    raise ValueError(f"json_schema constraint: {key} (at {at}/{i}/{key}) must be an object")
                joined = dict(schema[key])
                for name, sub in value.items():
                    if name in joined and joined[name] != sub:
                        what = "property" if key == "properties" else "definition"
                        raise ValueError(f"json_schema constraint: allOf (at {at}) gives {what} {name!r} two "
                                         f"different schemas; hylo merges allOf branches only where they do not "
                                         f"overlap")
                    joined[name] = sub
                schema[key] = joined
            elif key == "required" and key in schema:
                if not isinstance(value, list) or not isinstance(schema[key], list):
                    raise ValueError(f"json_schema constraint: required (at {at}/{i}) must be a list of names")
                schema[key] = list(dict.fromkeys(schema[key] + value))
            elif key == "type" and key in schema:
                schema[key] = _intersect_types(schema[key], value, f"{at}/{i}")
            elif key not in schema or schema[key] == value:
                schema[key] = value
            else:
                raise ValueError(f"json_schema constraint: allOf (at {at}) sets {key!r} to {json.dumps(schema[key])} "
                                 f"and {json.dumps(value)}; hylo merges allOf branches only where they do not "
                                 f"overlap: merge them into one schema")
    return schema


def _intersect_types(a, b, at: str):
    def expand(t):
        types = _type_names(t)
        if types is None:
            raise ValueError(f"json_schema constraint: type (at {at}) must be a name or a list of names")
        return types | ({"integer"} if "number" in types else set())

    both = expand(a) & expand(b)
    if "number" in both:
        both.discard("integer")
    if not both:
        raise ValueError(f"json_schema constraint: allOf (at {at}) asks for type {json.dumps(a)} and "
                         f"{json.dumps(b)}: nothing matches both")
    order = [t for t in (a if isinstance(a, list) else [a]) + ["integer"] if t in both]
    order = list(dict.fromkeys(order))
    return order[0] if len(order) == 1 else order


def _check_combination(schema: dict, where: str) -> None:
    """One family of keywords per schema, as the translation reads it (see the module's docstring)."""
    keys = [k for k in schema if k not in _NOT_CONSTRAINTS and not _is_neutral(k, schema[k])]
    at = where or "/"
    for lead, allowed, advice in (("$ref", (), "move them into the referenced schema"),
                                  ("anyOf", (), "move them into each branch"),
                                  ("oneOf", (), "move them into each branch"),
                                  ("enum", ("type",), "drop them"), ("const", ("type",), "drop them")):
        others = [k for k in keys if k != lead and k not in allowed]
        if lead in schema and others:
            raise ValueError(f"json_schema constraint: {lead} (at {at}) beside {', '.join(others)} is not enforced "
                             f"by hylo's constrained decoding (the translation reads only one of them); {advice}")
    if ("enum" in schema or "const" in schema) and "type" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        for v in values if isinstance(values, list) else []:
            if not any(_is_type(v, t) for t in types):
                which = "enum" if "enum" in schema else "const"
                raise ValueError(f"json_schema constraint: {which} value {json.dumps(v)} (at {at}) is not of type "
                                 f"{json.dumps(schema['type'])}")
    families = [f for f in _STRING_FAMILIES if any(k in schema for k in f)]
    if len(families) > 1:
        names = [k for f in families for k in f if k in schema]
        raise ValueError(f"json_schema constraint: {' beside '.join(names)} (at {at}) is not enforced by hylo's "
                         f"constrained decoding (the translation reads only {names[0]}); write the length into the "
                         f"pattern ({{m,n}}) or keep one of them")
    if "prefixItems" in schema and schema.get("items", False) is not False:
        raise ValueError(f"json_schema constraint: prefixItems beside items (at {at}) is not enforced by hylo's "
                         f"constrained decoding: the items after the prefix would be left out")
    for name in schema.get("properties") or {}:
        if any(c in '"\\' or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in name):
            raise ValueError(f"json_schema constraint: property name {name!r} (at {where}/properties) holds a "
                             f"quote, a backslash or a control character, which hylo's constrained decoding "
                             f"does not escape; rename it")


def _is_type(value, t: str) -> bool:
    kinds = {"string": str, "object": dict, "array": list, "boolean": bool, "null": type(None)}
    if t in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return t == "number" or float(value).is_integer()
    return t in kinds and isinstance(value, kinds[t])


def _check_refs(root, where: str) -> None:
    """Every ``$ref`` local (``#`` or ``#/...``), resolving, and not reaching itself again: the translation cuts a
    recursive schema at a depth by dropping the recursive member, which leaves invalid JSON or drops a required
    property, so recursion is refused; unroll it to a fixed depth in the schema."""
    done: set[str] = set()

    def resolve(ref: str):
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(f"json_schema constraint: $ref {ref!r} is not supported: only references inside the "
                             f"schema (#/$defs/NAME) are")
        node = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"json_schema constraint: $ref {ref!r} does not resolve inside the schema")
        return node

    def visit(node, stack: tuple[str, ...]):
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if ref is not None:
            if ref in stack:
                raise ValueError(f"json_schema constraint: $ref {ref!r} is recursive (through "
                                 f"{' -> '.join(stack[stack.index(ref):] + (ref,))}), which hylo's constrained "
                                 f"decoding cannot follow without bound; unroll it to a fixed depth in the schema")
            if ref not in done:
                visit(resolve(ref), stack + (ref,))
                done.add(ref)
        for _, _, sub in _subschemas(node, definitions=False):  # definitions count where they are referenced
            visit(sub, stack)

    visit(root, ("#",))
