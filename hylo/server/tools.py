"""Tool calls on chat: the request's ``tools`` checked and handed to the chat template, the model's calls parsed
back into OpenAI's ``message.tool_calls``, and, with ``tool_choice`` ``required`` or a named function, the output
constrained to calls whose arguments follow the functions' JSON schemas.

Two call formats, the one the model's template teaches (``call_format``):
- ``json`` (Qwen3, Qwen3-Next, hylo's own ChatML template): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>``;
- ``xml`` (Qwen3.5, Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>``, a string value as it is, any other value as JSON.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass

from ..constrain.schema import prepare_schema, schema_regex
from ..constrain.spec import Constraint, escape
from .protocol import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@dataclass
class Tools:
    """A chat request's tools, as given (for the template) and by name (their parameter schemas)."""

    specs: list[dict]
    params: dict[str, dict]
    choice: str | None  # "auto", "required", a function name; None: "none" (tools neither rendered nor parsed)
    parallel: bool
    call_format: str

    def finish_reason(self, finish: str | None) -> str | None:
        """A choice's finish reason once its output parsed into calls: "tool_calls" where it stopped by itself, as
        OpenAI (and vLLM) answer, except for a named function, which the request forced: "stop" stays."""
        return "tool_calls" if finish == "stop" and self.choice in ("auto", "required") else finish

    def constraint(self) -> Constraint | None:
        """With ``required`` or a named function: the calls the output must consist of (one, or several with
        parallel calls); None with ``auto``."""
        if self.choice in (None, "auto"):
            return None
        names = list(self.params) if self.choice == "required" else [self.choice]
        calls = "|".join(_call_regex(n, self.params[n], self.call_format) for n in names)
        one = f"({calls})"
        try:
            return Constraint.regex(f"{one}(\\n{one})*" if self.parallel else one)
        except ValueError as e:  # too large to compile
            raise APIError(f"tools: {str(e).replace('regex constraint', 'the calls', 1)}", param="tools") from None


def parse_tools(body, template: str | None) -> Tools | None:
    """The request's tools and tool_choice, checked (400s naming the problem); None when it has none or
    tool_choice is "none"."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    params: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise APIError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                           param="tools")
        if name in params:
            raise APIError(f"tools[{i}]: function {name!r} is given twice", param="tools")
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        params[name] = schema
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError("tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': NAME}}", param="tool_choice")
        if name not in params:
            raise APIError(f"tool_choice names function {name!r}, which is not among the tools", param="tool_choice")
        choice = name
    elif choice is None:
        choice = "auto"
    elif choice not in ("auto", "required"):
        raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                       param="tool_choice")
    if template is not None and "tools" not in template:
        raise APIError("this model's chat template does not render tools", param="tools",
                       code="unsupported_parameter")
    fmt = "xml" if template is not None and "<function=" in template else "json"
    out = Tools(list(tools), params, choice, body.parallel_tool_calls is not False, fmt)
    if choice != "auto":
        for name in ([choice] if choice != "required" else params):
            try:
                params[name] = prepare_schema(params[name], f"/{name}/parameters")
            except ValueError as e:
                raise APIError(f"tools: {e}", param="tools") from None
    return out


def _call_regex(name: str, schema: dict, call_format: str) -> str:
    def value(sub: dict) -> str:
        try:
            return schema_regex(sub, f"tools: function {name!r}: its parameters cannot be enforced")
        except ValueError as e:
            raise APIError(str(e), param="tools") from None

    if call_format == "json":
        return escape(f'<tool_call>\n{{"name": "{name}", "arguments": ') + value(schema) + escape("}\n</tool_call>")
    # xml: each property as a parameter block, the required ones in order, the others optional
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    blocks = []
    for key, sub in props.items():
        body = _xml_string(sub, value) if sub.get("type") == "string" else value(sub)
        block = escape(f"<parameter={key}>\n") + body + escape("\n</parameter>\n")
        blocks.append(block if key in required else f"({block})?")
    return (escape(f"<tool_call>\n<function={name}>\n") + "".join(blocks) + escape("</function>\n</tool_call>"))


def _xml_string(sub: dict, value) -> str:
    """A string parameter's value in the XML form: the text itself, not JSON (no quotes, no escapes), without '<'
    (which would close it); its enum, const, pattern, format and length bounds kept."""
    if "enum" in sub or "const" in sub:
        options = sub["enum"] if "enum" in sub else [sub["const"]]
        if not all(isinstance(o, str) for o in options):
            return value(sub)
        return "(" + "|".join(escape(o) for o in options) + ")"
    if "pattern" in sub:
        body = sub["pattern"].removeprefix("^")
        return f"({body[:-1] if body.endswith('$') and not body.endswith(chr(92) + '$') else body})"
    if "format" in sub:
        quoted = value(sub)  # the translation writes the format between quotes: the text inside them
        return quoted[1:-1] if quoted.startswith('"') and quoted.endswith('"') else quoted
    return f"[^<]{{{sub.get('minLength', 0)},{sub.get('maxLength', '')}}}"


def parse_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(the content outside the calls, or None when there is none; the calls in OpenAI's shape) of a finished
    output. A call that does not parse, or names an unknown function, stays in the content. The whitespace next to
    the calls is left out, not the text's own leading whitespace: what a stream sends before the first call
    (``held_back`` keeps a text's trailing whitespace until more text comes) and then parses from it add up to this."""
    calls, spans = [], []
    pattern = _JSON_CALL if tools.call_format == "json" else _XML_CALL
    for m in pattern.finditer(text):
        call = _json_call(m.group(1), tools) if tools.call_format == "json" else _xml_call(m, tools)
        if call is not None:
            calls.append(call)
            spans.append(m.span())
    if not calls:
        return text, []
    rest, last = [], 0
    for a, b in spans:
        rest.append(text[last:a])
        last = b
    rest.append(text[last:])
    content = rest[0].rstrip() + "".join(rest[1:]).strip()
    return content if content.strip() else None, calls


def _openai_call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str):
    """``json.loads`` without Python's extensions: NaN, Infinity and numbers past float's range (1e999) are
    refused (ValueError), so that a call's arguments, dumped again, are JSON that any client can parse."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)


def _json_call(text: str, tools: Tools) -> dict | None:
    try:
        obj = strict_json(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools.params:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = strict_json(args)
        except ValueError:
            return None
    return _openai_call(obj["name"], args) if isinstance(args, dict) else None


def _xml_call(m: re.Match, tools: Tools) -> dict | None:
    name = m.group(1).strip()
    if name not in tools.params:
        return None
    props = tools.params[name].get("properties") or {}
    args = {}
    for p in _XML_PARAM.finditer(m.group(2)):
        key, raw = p.group(1).strip(), p.group(2)
        if (props.get(key) or {}).get("type") == "string":
            args[key] = raw
        else:
            try:
                args[key] = strict_json(raw)
            except ValueError:
                args[key] = raw
    return _openai_call(name, args)


class CallStream:
    """One streamed choice's text with tools: what to send now, and at the end its content and calls. The text
    from a possible call's start (and the whitespace before it) is held back until the choice ends, then parsed;
    the content sent adds up to what ``parse_calls`` gives the whole text."""

    def __init__(self, tools: Tools):
        self.tools, self.held = tools, ""

    def feed(self, text: str) -> str:
        """The text that can be sent now."""
        text = self.held + text
        keep = held_back(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self, text: str) -> tuple[str | None, list[dict]]:
        """The rest of the content (None: nothing) and the calls, once the choice's last text has come."""
        content, calls = parse_calls(self.held + text, self.tools)
        self.held = ""
        return content or None, calls


def held_back(text: str) -> int:
    """How many characters at the end of a streamed text may start a tool call, or be the whitespace before one
    (held back until it is known whether they do): from the first ``<tool_call>``, or a partial one at the very
    end, and the whitespace before either."""
    at = text.find(OPEN)
    if at >= 0:
        keep = len(text) - at
    else:
        keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), 0)
    while keep < len(text) and text[len(text) - keep - 1].isspace():
        keep += 1
    return keep
