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
