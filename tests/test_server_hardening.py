"""Requests that a fuzz of the live server (session 29: about 1600 malformed and edge-case requests against the
embedded model) found answered with a 500 and a traceback, with a hang, or with a 200 carrying garbage. Each is now
a 400 naming the problem, or served as a user would expect; and the server keeps serving afterwards."""

import json
import time

import pytest

from hylo import SamplingParams
from hylo.config import EngineConfig
from hylo.constrain.spec import MAX_REGEX_POSITIONS, Constraint, regex_positions
from hylo.engine.engine import Engine

MODEL = "hylo-default-random"  # a byte-level tokenizer: ids 0..255 are bytes, 256.. its special tokens
LEN = 1024  # the context limit


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    from hylo.server.app import create_app

    engine = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False, max_model_len=LEN))
    with TestClient(create_app(engine)) as client:
        yield client


def _error(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    return err["message"]


def _still_serving(http):
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


TOOLS = [{"type": "function", "function": {"name": "get_w", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": "get_w"}, {"type": "function", "function": 5},
    {"type": "function", "function": [1]}, {"type": "function", "function": {"name": ["get_w"]}},
    {"type": "function", "function": {"name": {"a": 1}}}, {"type": "function", "function": None}, {},
    {"type": "tool", "function": {"name": "get_w"}},
])
def test_a_tool_choice_of_the_wrong_shape_is_a_400(http, choice):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "tools": TOOLS, "tool_choice": choice})
    assert "tool_choice must be" in _error(r, "tool_choice")
    # a named choice without "type" is OpenAI's shape less its tag: served
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                                                "tools": TOOLS, "tool_choice": {"function": {"name": "get_w"}}})
    assert r.status_code == 200, r.text


def _raw(http, path, body: str):
    """Post a JSON text as written (a lone surrogate escape survives only this way: the client's own encoder
    would refuse it)."""
    return http.post(path, content=body.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "a\\udc00b"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}], '
                             '"max_tokens": 2}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
])
def test_a_lone_surrogate_is_a_400_not_a_500(http, path, body, param):
    assert "lone UTF-16 surrogate" in _error(_raw(http, path, body), param)
    _still_serving(http)


def test_tokenize_without_messages_is_a_400(http):
    assert "at least one message" in _error(http.post("/tokenize", json={"messages": []}), "messages")


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "a{100000}"}}, "structured_outputs"),
    ({"prompt": "x", "max_tokens": 2, "guided_regex": "(ab{300}){300}"}, "guided_regex"),
    ({"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "a{1000000}"}}}}, "response_format"),
    ({"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "maxLength": 10 ** 12}}}}, "response_format"),
])
def test_a_constraint_too_large_to_compile_is_refused_at_once(http, body, param):
    """These compiled for minutes in a thread nobody could stop (gigabytes of memory kept in the cache)."""
    start = time.perf_counter()
    msg = _error(http.post("/v1/completions", json=body), param)
    assert time.perf_counter() - start < 10
    assert f"more than the {MAX_REGEX_POSITIONS} hylo compiles" in msg
    _still_serving(http)


def test_regex_positions_multiplies_counted_repetitions_out():
    assert regex_positions("abc") == 3
    assert regex_positions("(ab){3}") == 6
    assert regex_positions("(a{100}){100}") == 10000
    assert regex_positions("a{2,7}b*") == 8
    assert regex_positions(r"\p{L}{5}") == 5  # an escape's braces are not a repetition
    assert regex_positions(r"[\]{}a]{7}") == 7  # nor are a class's
    assert regex_positions(r"\d{3}-\d{4}") == 8
    # an open count is its copies and one starred copy: {0,} is * (it used to take the atom away)
    assert regex_positions("a{0,}") == regex_positions("a*") == 1
    assert regex_positions("(ab){2,}") == 6 and regex_positions("(x(,x){0,})") == 3
    # the translations hylo makes itself stay far below the bound
    assert regex_positions(Constraint.json_object().to_regex()) < MAX_REGEX_POSITIONS // 4
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 100}}, "required": ["a"]}
    assert 100 < regex_positions(Constraint.json_schema(schema).to_regex()) < 400


def _nested_arrays(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_of_nested_arrays_is_refused_not_fatal(http):
    """A 300-byte schema of arrays nested ten deep writes its item twice per level: its automaton took the whole
    server down (21 GB, then the out-of-memory killer). Its size is now counted right and refused at once."""
    start = time.perf_counter()
    msg = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2,
                                                     "guided_json": _nested_arrays(10)}), "guided_json")
    assert time.perf_counter() - start < 10 and f"more than the {MAX_REGEX_POSITIONS} hylo compiles" in msg
    _still_serving(http)


def test_a_schema_nested_past_the_depth_limit_is_a_400(http):
    """340 nested objects (20 KB) exhausted the recursion limit: a 500 and a traceback in the log."""
    schema = {"type": "string"}
    for _ in range(340):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    msg = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "response_format": fmt}),
                 "response_format")
    assert "more than 64 deep" in msg
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400 and "more than 64 deep" in r.json()["error"]["message"]
    _still_serving(http)


def test_a_compile_past_its_limits_is_refused_and_harms_nothing(http, monkeypatch):
    """What no size bound sees (a small expression whose automaton is exponential, arrays nested eight deep)
    compiles in a child process with a time and memory limit: past them the request is refused, and the server
    and its other constraints go on."""
    import hylo.constrain.automaton as automaton

    monkeypatch.setattr(automaton, "COMPILE_TIMEOUT_S", 3.0)
    start = time.perf_counter()
    msg = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2,
                                                     "guided_regex": "(a|b)*a(a|b){22}"}), "guided_regex")
    assert "did not compile within 3 s" in msg and time.perf_counter() - start < 30
    monkeypatch.setattr(automaton, "COMPILE_TIMEOUT_S", 120.0)
    monkeypatch.setattr(automaton, "COMPILE_MEMORY_BYTES", 600 << 20)
    msg = _error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2,
                                                     "guided_json": _nested_arrays(8)}), "guided_json")
    assert "needs more than 0.586 GiB to compile" in msg
    r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "guided_regex": "[0-9]{4}"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].isdigit()
    _still_serving(http)


def test_a_temperature_below_1e_5_is_greedy(http):
    """1e-39 divided the float32 logits into infinities: every draw was token 0."""
    assert SamplingParams(temperature=1e-39).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    base = {"prompt": "import os", "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, "seed": 3}
    greedy = http.post("/v1/completions", json={**base, "temperature": 0}).json()["choices"][0]["token_ids"]
    for t in (1e-39, 1e-320, 5e-6):
        got = http.post("/v1/completions", json={**base, "temperature": t}).json()["choices"][0]["token_ids"]
        assert got == greedy, t


def test_a_vanishing_repetition_penalty_is_a_400(http):
    msg = _error(http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "repetition_penalty": 1e-39}),
                 "repetition_penalty")
    assert "between 0.01 and 100" in msg
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.001)


def test_max_completion_tokens_gets_the_context_check_on_completions(http):
    """It was silently clamped to the room left (or ran to the context's end), where max_tokens was refused."""
    prompt = [65] * (LEN - 6)
    msg = _error(http.post("/v1/completions", json={"prompt": prompt, "max_completion_tokens": 100}),
                 "max_completion_tokens")
    assert "max_completion_tokens is 100" in msg and "at most 6 tokens fit" in msg
    msg = _error(http.post("/v1/completions", json={"prompt": "ab", "max_completion_tokens": 2 ** 63 - 1}),
                 "max_completion_tokens")
    msg = _error(http.post("/v1/completions", json={"prompt": "ab", "max_completion_tokens": 0}),
                 "max_completion_tokens")
    assert "max_completion_tokens must be at least 1" in msg
    r = http.post("/v1/completions", json={"prompt": prompt, "max_completion_tokens": 6, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    # echo with a limit of 0 scores the prompt, whichever field says it
    r = http.post("/v1/completions", json={"prompt": "abc", "echo": True, "max_completion_tokens": 0,
                                           "logprobs": 0}).json()["choices"][0]
    assert r["text"] == "abc" and len(r["logprobs"]["tokens"]) == 3


@pytest.mark.parametrize("prompt", [[256, 257, 104, 105, 258], "<|endoftext|><|im_start|>hi<|im_end|>"])
def test_text_offset_points_into_the_text(http, prompt):
    """Special tokens are not in a decoded text: they take no characters there (they took their names' before),
    except in an echoed prompt string, which holds them as written."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 0, "ignore_eos": True}
    for stream in (False, True):
        if stream:
            lines = http.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
            chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
            offsets = [o for c in chunks if c["choices"][0]["logprobs"]
                       for o in c["choices"][0]["logprobs"]["text_offset"]]
        else:
            choice = http.post("/v1/completions", json=body).json()["choices"][0]
            text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        assert len(tokens) == len(offsets) == 5 + 4
        assert offsets == sorted(offsets) and offsets[-1] <= len(text)
        specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
        verbatim = isinstance(prompt, str)
        for i, (tok, at) in enumerate(zip(tokens, offsets)):
            if tok in specials and not (verbatim and i < 5):
                assert i + 1 == len(offsets) or offsets[i + 1] == at  # takes no characters
            elif tok.isprintable() and not tok.startswith("bytes:"):
                assert text[at:at + len(tok)] == tok, (i, tok, at, text)


def test_text_offset_after_an_invalid_byte_belongs_to_its_token(http):
    """A lead byte no continuation follows becomes U+FFFD when the next token comes: that character is the lead
    byte's token's, so the next token starts after it."""
    ids = [ord("a"), 0xC3, ord(" "), ord("b"), 0xE6, 0x97, ord("c")]  # 'a', a lone lead, ' ', 'b', a cut 3-byte
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1, "ignore_eos": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text.startswith("a\ufffd b\ufffdc")
    assert offsets[:len(ids)] == [0, 1, 2, 3, 4, 4, 5]
    assert text[offsets[2]] == " " and text[offsets[6]] == "c"


def test_text_offset_counts_characters_split_over_byte_tokens(http):
    """A character whose bytes come in several tokens counts once its last byte has come: every token holding
    part of it points at it, and no offset runs past the text (each byte counted one character before), streamed
    or not; a token that is part of a character is written ``bytes:\\xNN`` (distinct keys in top_logprobs)."""
    word = "aé日b"
    ids = list(word.encode())  # the byte-level model: ids 0..255 are the bytes
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 3, "ignore_eos": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(word)
    assert lp["text_offset"][:len(ids)] == [0, 1, 1, 2, 2, 2, 3]
    assert lp["tokens"][:3] == ["a", "bytes:\\xc3", "bytes:\\xa9"] and lp["tokens"][6] == "b"
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(choice["text"])
    for top in lp["top_logprobs"][1:]:
        assert len(top) >= 3  # the top 3 (and the chosen token): no two byte tokens share a key
    lines = http.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    streamed = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == lp["text_offset"]


def test_prompts_are_encoded_off_the_event_loop(http, monkeypatch):
    """Encoding a prompt (and rendering a chat template) runs in a worker thread: megabytes of prompt take seconds
    to encode, and on the event loop they stalled every stream and /health meanwhile."""
    import asyncio

    seen = []
    encode = Engine.encode_prompt

    def spy(self, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            seen.append("event loop")
        except RuntimeError:
            seen.append("worker thread")
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "encode_prompt", spy)
    assert http.post("/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 1}).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 1}).status_code == 200
    assert seen and set(seen) == {"worker thread"}, seen


@pytest.mark.parametrize("body, param", [
    ({"user": {"a": 1}}, "user"), ({"user": 5}, "user"), ({"store": "yes"}, "store"), ({"priority": True}, "priority"),
    ({"response_format": {"foo": 1}}, "response_format"), ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
])
def test_bookkeeping_fields_of_the_wrong_type_are_refused(http, body, param):
    """OpenAI's bookkeeping fields change nothing but still have a type; response_format needs its type."""
    _error(http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, **body}), param)


def test_a_validators_message_reads_without_pydantics_prefix(http):
    message = _error(http.post("/v1/completions", json={"prompt": "ab", "temperature": "1"}), "temperature")
    assert message.startswith("temperature: expected a number") and "Value error" not in message


def test_bookkeeping_fields_of_their_type_are_accepted_and_a_405_says_what_is_allowed(http):
    body = {"prompt": "ab", "max_tokens": 1, "user": "u-1", "store": False, "metadata": {"k": "v"}, "priority": 0,
            "parallel_tool_calls": True, "response_format": {"type": "text"}}
    assert http.post("/v1/completions", json=body).status_code == 200
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    _still_serving(http)


def test_a_body_that_is_not_json_says_what_is_expected(http):
    r = http.post("/v1/completions", content=b"prompt=hi", headers={"content-type": "application/x-www-form-urlencoded"})
    msg = _error(r, None)
    assert "JSON object" in msg and "application/x-www-form-urlencoded" in msg
    msg = _error(http.post("/v1/completions", content=b"", headers={"content-type": "application/json"}), None)
    assert "JSON object" in msg
    _still_serving(http)


@pytest.mark.parametrize("schema,words", [
    ({"type": "string", "maxLength": -1}, "maxLength (at /maxLength) must be a non-negative integer"),
    ({"type": "array", "maxItems": -1}, "maxItems (at /maxItems) must be a non-negative integer"),
    ({"enum": []}, "enum (at /enum) is empty"),
    ({"type": []}, "type (at /type) is empty"),
    ({"type": "object", "required": ["zz"], "properties": {}}, "required property 'zz'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}, "required property 'b'"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 is more than maxItems 1"),
])
def test_a_schema_the_translation_would_loosen_is_refused(http, schema, words):
    """Each was served with a 200 whose output did not validate against the schema (or could not)."""
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert words in _error(r, "response_format")


def test_min_tokens_with_a_constraint_is_refused(http):
    """The constraint's end took precedence without a word: one token where five were asked for."""
    r = http.post("/v1/completions", json={"prompt": "x = ", "structured_outputs": {"choice": ["a"]},
                                           "min_tokens": 5, "max_tokens": 6})
    assert "min_tokens cannot be combined with a constraint" in _error(r, "min_tokens")


def test_tool_call_arguments_are_strict_json():
    """Python's json reads NaN, Infinity and 1e999; dumped again they are not JSON a client can parse. Such a call
    stays in the content."""
    from hylo.server.tools import Tools, parse_calls

    tools = Tools(TOOLS, {"get_w": {"type": "object"}}, "auto", True, "json")
    for args in ('{"a": NaN}', '{"a": 1e999}', '{"a": -Infinity}'):
        text = f'<tool_call>\n{{"name": "get_w", "arguments": {args}}}\n</tool_call>'
        assert parse_calls(text, tools) == (text, [])
    content, calls = parse_calls('<tool_call>\n{"name": "get_w", "arguments": {"a": 1.5e3}}\n</tool_call>', tools)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 1500.0}


@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("max_tokens", "5"), ("n", True), ("seed", "1"), ("temperature", True),
    ("temperature", "0.5"), ("top_k", False), ("logprobs", True), ("stream", "yes"), ("stream", 1),
    ("echo", "true"), ("ignore_eos", 0), ("prompt", [True, 66]), ("logit_bias", {"65": True}),
    ("logit_bias", {"\u0663": 5}), ("stream_options", {"include_usage": True, "foo": 1}),
])
def test_values_are_not_coerced(http, field, value):
    """Pydantic's lax mode read true as 1, "5" as 5 and "yes" as true; a request now means what it says."""
    body = {"prompt": "ab", "max_tokens": 2, field: value}
    if field == "stream_options":
        body["stream"] = True
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, (field, value, r.text)
    assert r.json()["error"]["param"] == field
    # JSON's spellings of the same values are served (5.0 is an integer's valid spelling, as in JSON Schema)
    assert http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2.0, "temperature": 0,
                                              "stream": False}).status_code == 200


def test_an_empty_stop_string_is_refused_as_an_empty_stop_list_entry_is(http):
    for stop in ("", [""]):
        assert "stop must be" in _error(http.post("/v1/completions", json={"prompt": "ab", "stop": stop}), "stop")
    assert http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stop": []}).status_code == 200


def test_chat_template_kwargs_cannot_set_the_requests_own_variables(http):
    for key in ("tools", "messages", "add_generation_prompt"):
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    "chat_template_kwargs": {key: 5}})
        assert f"{key!r} is set by the request itself" in _error(r, "chat_template_kwargs")
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200


def test_audit_of_session_35_edges(http):
    """A second audit's finds: each named by the field the client sent, never a 500."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    # too many stop strings: each is searched after every token, on the thread every request shares
    assert "stop takes at most 32" in _error(http.post("/v1/completions", json={
        "prompt": "ab", "stop": [f"s{i}" for i in range(1000)]}), "stop")
    # a logit_bias key past int()'s digit limit is not a token id, not an error about Python's limits
    assert "are not token ids" in _error(http.post("/v1/completions", json={
        "prompt": "ab", "logit_bias": {"1" * 5000: 1}}), "logit_bias")
    # a chat prompt past the context is the messages' fault
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * (2 * LEN)}]})
    assert "context limit" in _error(r, "messages")
    # min_tokens past the default max_tokens names the default, not a field the client did not send
    r = http.post("/v1/chat/completions", json={**chat, "min_tokens": 5 * LEN})
    assert "max_tokens (not given)" in _error(r, "min_tokens")
    r = http.post("/v1/completions", json={"prompt": "ab", "min_tokens": 20})
    assert "more than the 16 tokens that max_tokens (not given)" in _error(r, "min_tokens")
    r = http.post("/v1/completions", json={"prompt": ["a" * (LEN - 8), "b"], "min_tokens": 10, "max_tokens": None})
    assert "at most" in _error(r, "min_tokens")
    _still_serving(http)


def test_the_default_max_tokens_fits_each_prompt_alone(http):
    """OpenAI's default of 16 output tokens is cut to the room each prompt leaves, not the longest one's for all."""
    r = http.post("/v1/completions", json={"prompt": ["a" * (LEN - 6), "b"], "temperature": 0, "ignore_eos": True,
                                           "logprobs": 0})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    used = [len(c["logprobs"]["tokens"]) for c in choices]
    assert used[0] in (5, 6) and used[1] == 16, used  # the long prompt's room (a byte tokenizer: a byte a token)
