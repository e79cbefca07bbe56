"""The server's edges, in process (FastAPI's TestClient drives the real app and engine thread): requests hylo cannot
serve are refused by name, never silently changed."""

import pytest

from hylo.config import EngineConfig
from hylo.engine.engine import Engine

MODEL = "hylo-default-random"


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    from hylo.server.app import create_app

    engine = Engine(MODEL, device="cpu", engine_config=EngineConfig(verbose=False))
    with TestClient(create_app(engine)) as client:
        yield client


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
])
def test_image_audio_and_video_content_is_refused_by_name(http, part):
    body = {"messages": [{"role": "system", "content": "hi"},
                         {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}],
            "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and err["code"] == "unsupported_content"
    assert f"messages[1].content[1]: '{part['type']}' content is not supported" in err["message"]
    # text parts alone are served
    r = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what "}, {"type": "text", "text": "is this?"}]}]})
    assert r.status_code == 200


def test_cached_prompt_tokens_are_reported(http):
    """The second turn of a conversation reuses the first's computed tokens: usage says how many
    (prompt_tokens_details.cached_tokens, streamed too), and /metrics counts them."""
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = http.post("/v1/completions", json={**body, "prompt": first}).json()
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert r["choices"][0]["prompt_token_ids"] == first
    out = r["choices"][0]["token_ids"]
    assert len(out) == r["usage"]["completion_tokens"] == 6
    second = first + out + [20, 21]
    r2 = http.post("/v1/completions", json={**body, "prompt": second}).json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first) + len(out) - 1
    with http.stream("POST", "/v1/completions", json={**body, "prompt": second + [22], "stream": True,
                                                      "stream_options": {"include_usage": True}}) as s:
        import json as _json

        chunks = [_json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(second) - 1
    metrics = http.get("/metrics").text
    hit = [ln for ln in metrics.splitlines() if ln.startswith("hylo_prefix_cache_hit_tokens_total ")]
    assert hit and float(hit[0].split()[1]) >= len(first) + len(out) - 1
    assert "hylo_prefix_cache_snapshots " in metrics and "hylo_prefix_cache_bytes " in metrics
