"""Structured output and tool calls through the server, driven by the official ``openai`` client (over FastAPI's
TestClient: the real app and engine thread, in process) on the trained embedded default model: response_format and
vLLM's structured_outputs validate, tool calls round-trip (forced by tool_choice, streamed and not), and every
malformed constraint is a 400 naming its field."""

import json
import re

import jsonschema
import pytest

from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.models.default import trained_default_path

openai = pytest.importorskip("openai")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "days": {"enum": [1, 2, 3, 7, 14]}}, "required": ["city", "days"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def app_client():
    from fastapi.testclient import TestClient

    from hylo.server.app import create_app

    engine = Engine(trained_default_path(), device="cpu", engine_config=EngineConfig(verbose=False))
    with TestClient(create_app(engine)) as http:
        yield http


@pytest.fixture(scope="module")
def client(app_client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=app_client, max_retries=0)


def _model(client):
    return client.models.list().data[0].id


def test_response_format_and_structured_outputs_validate(client):
    m = _model(client)
    r = client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "a trip"}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(model=m, messages=[{"role": "user", "content": "an object"}], max_tokens=60,
                                       temperature=0.8, seed=3, response_format={"type": "json_object"}, n=2)
    for c in r.choices:
        assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)
    r = client.completions.create(model=m, prompt="def f():", max_tokens=20, temperature=0.7, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[a-z]{3,8}\\(\\)"}})
    assert re.fullmatch("[a-z]{3,8}\\(\\)", r.choices[0].text)
    r = client.completions.create(model=m, prompt="x = ", max_tokens=10, temperature=1.0, seed=2,
                                  extra_body={"structured_outputs": {"choice": ["None", "True", "[]"]}})
    assert r.choices[0].text in ("None", "True", "[]")
    stream = client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "a trip"}], max_tokens=80, temperature=0, stream=True,
        extra_body={"guided_json": SCHEMA})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_round_trip(client, stream):
    """tool_choice "required" and a named function force calls whose arguments follow the function's schema;
    they come back as message.tool_calls (streamed: as tool_calls deltas) with finish_reason tool_calls ("stop" for
    a named function, which the request forced, as OpenAI answers), and the conversation goes on with the call and
    its result in the history."""
    m = _model(client)
    msgs = [{"role": "user", "content": "weather in Oslo?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(model=m, messages=msgs, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=80, temperature=0)
        if stream:
            calls, finish, empty = {}, None, 0
            for ch in client.chat.completions.create(stream=True, **kw):
                delta = ch.choices[0].delta
                for d in delta.tool_calls or []:
                    calls.setdefault(d.index, d)
                finish = ch.choices[0].finish_reason or finish
                empty += not (delta.role or delta.content or delta.tool_calls or ch.choices[0].finish_reason)
            assert empty == 0  # the text held back while it may be a call sends no empty chunks
            calls = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(**kw)
            calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert finish == ("stop" if isinstance(choice, dict) else "tool_calls") and calls
        for call in calls:
            tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            assert call.id and call.type == "function"
        if isinstance(choice, dict):
            assert all(c.function.name == "get_time" for c in calls)
    # the calls and a tool's answer in the history: the template renders them, the next turn is served
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls]}] + [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls]
    r = client.chat.completions.create(model=m, messages=history, tools=[WEATHER, CLOCK], max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_call_parsing():
    """The model's calls in both of Qwen's formats, text around them kept as content; malformed or unknown calls
    stay text."""
    from hylo.server.tools import Tools, held_back, parse_calls

    params = {"get_weather": WEATHER["function"]["parameters"]}
    js = Tools([WEATHER], params, "auto", True, "json")
    content, calls = parse_calls('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                                 '"unit": "c"}}\n</tool_call>', js)
    assert content == "Let me check." and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert parse_calls('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', js)[1] == []
    assert parse_calls("<tool_call>\n{broken\n</tool_call>", js)[1] == []
    xml = Tools([WEATHER], {"get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                                            "days": {"type": "integer"}}}},
                "auto", True, "xml")
    content, calls = parse_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                                 "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", xml)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "New York", "days": 3}
    # held back: a (partial) call's start and the whitespace before it
    assert held_back("abc <tool") == 6 and held_back("abc <tool_call>\n{") == 14 and held_back("abc") == 0
    assert held_back("abc \n") == 2 and held_back("a <tool_call>b c ") == len(" <tool_call>b c ")


@pytest.mark.parametrize("text", [
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',
    '\n\nSure.\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n',
    'No call here, just text with < and <tool and spaces.   ',
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> after',
])
def test_streamed_tool_calls_add_up_to_the_parsed_text(text):
    """A streamed choice's content deltas, whatever the chunks, add up to the content a non-streamed response
    gives (``parse_calls`` of the whole text), and its calls are the same."""
    from hylo.server.tools import CallStream, Tools, parse_calls

    tools = Tools([WEATHER], {"get_weather": WEATHER["function"]["parameters"]}, "auto", True, "json")
    content, calls = parse_calls(text, tools)
    for size in (1, 3, 7, len(text)):
        stream = CallStream(tools)
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        sent = "".join(stream.feed(c) for c in chunks[:-1])
        rest, streamed_calls = stream.finish(chunks[-1])
        assert ((sent + (rest or "")) or None) == content, (size, sent, rest)
        assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]


def test_xml_call_constraint_follows_the_schema():
    """Qwen3.5's XML call format under tool_choice: the constraint's language holds exactly well-formed calls (a
    good call matches; a wrong enum value, a missing required parameter, a string past its maxLength do not)."""
    from hylo.server.tools import Tools, parse_calls

    params = {"get_weather": WEATHER["function"]["parameters"]}
    c = Tools([WEATHER], params, "required", False, "xml").constraint()
    good = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=unit>\n\"c\"\n" \
           "</parameter>\n</function>\n</tool_call>"
    assert re.fullmatch(c.value, good)
    assert not re.fullmatch(c.value, good.replace('"c"', '"k"'))
    assert not re.fullmatch(c.value, good.replace("<parameter=unit>\n\"c\"\n</parameter>\n", ""))
    assert not re.fullmatch(c.value, good.replace("Oslo", "Oslo-and-far-beyond"))  # maxLength 12 kept
    # string parameters are written as text: an enum of strings without quotes, a pattern's text as it is
    params = {"f": {"type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "slow"]},
                                                     "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                    "required": ["mode", "code"]}}
    c = Tools([], params, "f", False, "xml").constraint()
    call = ("<tool_call>\n<function=f>\n<parameter=mode>\nfast\n</parameter>\n<parameter=code>\nABC\n"
            "</parameter>\n</function>\n</tool_call>")
    assert re.fullmatch(c.value, call) and not re.fullmatch(c.value, call.replace("fast", '"fast"'))
    tools = Tools([], params, "auto", False, "xml")
    assert json.loads(parse_calls(call, tools)[1][0]["function"]["arguments"]) == {"mode": "fast", "code": "ABC"}


def test_forced_calls_merge_allof_parameters():
    """A function whose parameters are allOf of two objects: the forced call's arguments hold both objects'
    properties in one JSON object (the schema translation alone would write two objects back to back)."""
    from types import SimpleNamespace

    from hylo.server.tools import parse_calls, parse_tools

    params = {"allOf": [{"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                         "required": ["city"]},
                        {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}]}
    body = SimpleNamespace(tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
                           tool_choice="required", parallel_tool_calls=False)
    tools = parse_tools(body, None)
    c = tools.constraint()
    call = '<tool_call>\n{"name": "f", "arguments": {"city": "Oslo", "zip": 150}}\n</tool_call>'
    assert re.fullmatch(c.value, call)
    assert not re.fullmatch(c.value, call.replace('"Oslo", ', '"Oslo"}{'))
    args = json.loads(parse_calls(call, tools)[1][0]["function"]["arguments"])
    jsonschema.validate(args, params)


def test_bad_constraints_and_tools_are_refused_by_name(app_client):
    h = {"Content-Type": "application/json"}
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    cases = [
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= undefined"}},
         "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": {}}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "whitespace_pattern": "[ ]*"}},
         "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"json_object": True,
                                                                  "disable_any_whitespace": True}},
         "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "guided_json": {"type": "integer", "minimum": 2}}, "guided_json"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"},
         "guided_regex"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools"),
        ("/v1/chat/completions", {**chat, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                              "function": {"name": "nope"}}},
         "tool_choice"),
        ("/v1/chat/completions", {**chat, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {**chat, "tools": [WEATHER], "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}}}}],
            "tool_choice": "required"}, "tools"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}}},
                                        "$ref": "#/$defs/n"}}}], "tool_choice": "required"}, "tools"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}}}}, "response_format"),
    ]
    for path, body, param in cases:
        r = app_client.post(path, json=body, headers=h)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    assert app_client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_a_grammar_the_matcher_gives_up_on_is_a_400_that_harms_no_other_request(app_client):
    """A grammar llguidance gives up on while decoding is a 400 for its request (an error event in its stream),
    while requests sent beside it finish as they do alone; a grammar no text matches is refused up front."""
    import threading

    h = {"Content-Type": "application/json"}
    plain = {"prompt": "def f(x):", "max_tokens": 40, "temperature": 0}
    alone = app_client.post("/v1/completions", json=plain, headers=h).json()["choices"][0]["text"]
    bad = {"prompt": "x", "max_tokens": 20, "structured_outputs": {"grammar": 'root ::= "a" root'}}
    results = {}

    def send(name, body):
        results[name] = app_client.post("/v1/completions", json=body, headers=h)

    threads = [threading.Thread(target=send, args=(f"plain{i}", plain)) for i in range(2)]
    threads += [threading.Thread(target=send, args=("bad", bad)),
                threading.Thread(target=send, args=("bad-stream", {**bad, "stream": True}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert results[f"plain{i}"].status_code == 200, results[f"plain{i}"].text
        assert results[f"plain{i}"].json()["choices"][0]["text"] == alone
    err = results["bad"]
    assert err.status_code == 400 and err.json()["error"]["type"] == "invalid_request_error", err.text
    assert "grammar constraint: the grammar engine stopped" in err.json()["error"]["message"]
    events = [line[6:] for line in results["bad-stream"].text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "invalid_request_error" in events[-2], events
    r = app_client.post("/v1/completions", json={**bad, "structured_outputs": {"grammar": "root ::= root"}},
                        headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


def test_compiles_are_counted_in_metrics(app_client):
    r = app_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 12, "guided_regex": "metrics[0-9]"})
    assert r.status_code == 200 and re.fullmatch("metrics[0-9]", r.json()["choices"][0]["text"])
    text = app_client.get("/metrics").text
    compiles = [line for line in text.splitlines() if line.startswith("hylo_constraint_compiles_total")]
    assert compiles and int(compiles[0].split()[-1]) >= 1
    assert "hylo_constraint_compile_seconds_total" in text
    # a grammar (matched on the host): served, its blocking reads counted
    r = app_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 12, "temperature": 0.5,
                                                 "structured_outputs": {"grammar": 'root ::= "n = " [0-9] [0-9]?'}})
    assert r.status_code == 200 and re.fullmatch("n = [0-9][0-9]?", r.json()["choices"][0]["text"])
    syncs = [line for line in app_client.get("/metrics").text.splitlines()
             if line.startswith("hylo_constraint_host_syncs_total")]
    assert syncs and int(syncs[0].split()[-1]) >= 1


# a chat template in Qwen3.5's style: tools listed as <function> blocks, calls written as XML parameters
XML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n<function><name>"
    "{{ t['function']['name'] }}</name></function>{% endfor %}\n</tools>\nCall a function as <tool_call>\n"
    "<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("stream", [False, True])
def test_xml_tool_calls_end_to_end(stream):
    """A model whose template teaches Qwen3.5's XML call format: a forced call is written in that format (its
    values following the function's schema: an enum as JSON, a plain string as text) and parsed back into
    OpenAI's tool_calls, streamed and not."""
    from fastapi.testclient import TestClient

    from hylo.server.app import create_app

    engine = Engine(trained_default_path(), device="cpu", engine_config=EngineConfig(verbose=False))
    engine.tokenizer.chat_template = XML_TEMPLATE
    with TestClient(create_app(engine)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        kw = dict(model=_model(client), messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
                  tool_choice="required", max_tokens=150, temperature=0, parallel_tool_calls=False)
        if stream:
            calls, finish = [], None
            for ch in client.chat.completions.create(stream=True, **kw):
                calls += ch.choices[0].delta.tool_calls or []
                finish = ch.choices[0].finish_reason or finish
        else:
            r = client.chat.completions.create(**kw)
            calls, finish = r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
