"""A property-based fuzz of the HTTP API, driven by its own /openapi.json: request bodies built from each endpoint's
schema (every property, of its declared type or deliberately not: huge and negative integers, NaN and infinite
floats, wrong types, nested junk), a bounded number of examples. Every answer must be a success or an OpenAI error
object (4xx, never a 500 or a traceback), and afterwards a greedy request still gives the right tokens."""

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hylo import SamplingParams  # noqa: E402
from hylo.config import EngineConfig  # noqa: E402
from hylo.engine.engine import Engine  # noqa: E402

MODEL = "hylo-default-random"
JUNK = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                 st.lists(st.integers(min_value=-5, max_value=600), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


@pytest.fixture(scope="module")
def app_client():
    from fastapi.testclient import TestClient

    from hylo.server.app import create_app

    engine = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False, max_model_len=256))
    with TestClient(create_app(engine)) as client:
        yield client, engine


def _resolve(schema: dict, spec: dict) -> dict:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _value(schema: dict, spec: dict, junk: bool, depth: int = 0):
    """A strategy for values of ``schema``: well typed and small (cheap requests), and with ``junk`` also values of
    any type and size."""
    schema = _resolve(schema, spec)
    if depth > 3:
        return JUNK if junk else st.none()
    options = [_value(s, spec, junk, depth + 1) for s in schema.get("anyOf", schema.get("oneOf", []))]
    kind = schema.get("type")
    if kind == "integer":
        options.append(st.integers(min_value=0 if not junk else -2, max_value=4 if not junk else 40))
    elif kind == "number":
        options.append(st.floats(min_value=0.0 if not junk else -3, max_value=1.0 if not junk else 3))
    elif kind == "boolean":
        options.append(st.booleans())
    elif kind == "string":
        options.append(st.sampled_from(schema["enum"]) if "enum" in schema else st.text(max_size=12))
    elif kind == "array":
        options.append(st.lists(_value(schema.get("items", {}), spec, junk, depth + 1), min_size=0 if junk else 1,
                                max_size=3))
    elif kind == "object":
        props = schema.get("properties", {})
        if props:
            required = {k: _value(props[k], spec, junk, depth + 1) for k in _resolve(schema, spec).get("required", [])}
            options.append(st.fixed_dictionaries(required, optional={k: _value(v, spec, junk, depth + 1)
                                                                     for k, v in props.items() if k not in required}))
        else:
            options.append(st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2))
    if "const" in schema:
        options.append(st.just(schema["const"]))
    if junk:
        options.append(JUNK)
    return st.one_of(*options)


def _bodies(path: str):
    """Request bodies for ``path`` from the served schema: some well typed with a few fields (most of which the
    server should serve), some with junk anywhere."""
    from fastapi.testclient import TestClient

    from hylo.server.app import create_app

    engine = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False))
    with TestClient(create_app(engine)) as c:
        spec = c.get("/openapi.json").json()
    schema = _resolve(spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"], spec)
    props = schema["properties"]

    def body(junk: bool):
        required = {k: _value(props[k], spec, junk) for k in schema.get("required", [])}
        fields = [k for k in props if k not in required and (junk or k not in ("model", "stream_options"))]
        chosen = st.lists(st.sampled_from(fields), max_size=8 if junk else 3, unique=True)
        return chosen.flatmap(lambda keys: st.fixed_dictionaries(
            {**required, **{k: _value(props[k], spec, junk) for k in keys}}))

    return st.one_of(body(False), body(True))


SEEN = {"ok": 0, "refused": 0}  # so that the fuzz provably reached both outcomes


def _check(r):
    assert r.status_code < 500, r.text
    SEEN["ok" if r.status_code == 200 else "refused"] += 1
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines and lines[-1] == "[DONE]", r.text[-300:]
        for ln in lines[:-1]:
            chunk = json.loads(ln)
            assert "choices" in chunk or set(chunk.get("error", {})) == {"message", "type", "param", "code"}
        return
    body = r.json()
    if r.status_code >= 400:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert "Traceback" not in err["message"]
    else:
        assert body["choices"]


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(body=_bodies("/v1/completions"))
def test_fuzz_completions(app_client, body):
    client, _ = app_client
    _check(_post(client, "/v1/completions", body))


@FUZZ
@given(body=_bodies("/v1/chat/completions"))
def test_fuzz_chat(app_client, body):
    client, _ = app_client
    _check(_post(client, "/v1/chat/completions", body))


def _post(client, path, body):
    """NaN and infinities as JSON's non-standard tokens: what a careless client sends too. Generation is kept to a
    few tokens (the fuzz is about the fields, not the length of the answers)."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
                body[key] = 4
        if not any(isinstance(body.get(k), int) for k in ("max_tokens", "max_completion_tokens")):
            body["max_tokens"] = 3
    return client.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})


def test_still_serving_right_after_the_fuzz(app_client):
    client, engine = app_client
    if SEEN["ok"] + SEEN["refused"]:  # (when run after the fuzz tests, as in the whole file)
        assert SEEN["ok"] >= 10 and SEEN["refused"] >= 10, SEEN
    assert client.get("/health").json() == {"status": "ok"}
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True, "return_token_ids": True})
    reference = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False))
    rid = reference.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while reference.has_unfinished():
        reference.step()
    assert r.json()["choices"][0]["token_ids"] == reference.pop_finished(rid).token_ids
