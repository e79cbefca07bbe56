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


def test_completion_logprobs_and_echo(http):
    # tokens as ids: byte tokens that are parts of a character would share the string "\ufffd" as a key
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = http.post("/v1/completions", json=body).json()
    c = r["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(c["token_ids"]) == 4
    assert all(len(t) == 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert all(lp["text_offset"][i] <= lp["text_offset"][i + 1] for i in range(3))
    # greedy: the chosen token is the most likely, its logprob the top one
    for tok, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert abs(tok - max(top.values())) < 1e-5
    echo = http.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    assert echo["logprobs"]["token_logprobs"][0] is None and echo["logprobs"]["top_logprobs"][0] is None
    assert len(echo["logprobs"]["tokens"]) == 4 + 4
    assert echo["logprobs"]["token_logprobs"][4:] == lp["token_logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    text = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
    assert len(text["choices"][0]["logprobs"]["tokens"]) == 4


def test_chat_logprobs_streamed_and_not(http):
    import json as _json

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3}
    full = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert len(full) == 5 and all(len(e["top_logprobs"]) == 3 and isinstance(e["bytes"], list) for e in full)
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [_json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    streamed = [e for ch in chunks for c in ch["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in full]
    # the same values up to float32 rounding: the second request reuses the first's cached prefix, so its prompt is
    # split at another point than the first's (which may reuse an earlier test's template prefix), and the sums over
    # the two parts round differently (docs/INTERNALS.md, "Log probabilities and logit processing")
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in full], abs=1e-5)
    r = http.post("/v1/chat/completions", json={**body, "logprobs": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_chat_stream_sends_one_role_chunk_per_choice_and_usage_in_every_chunk(http):
    import json as _json

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "stream": True,
            "temperature": 1.0, "seed": 5, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as s:
        chunks = [_json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    roles = [ch for ch in chunks[:3]]
    assert [len(ch["choices"]) for ch in roles] == [1, 1, 1]
    assert sorted(ch["choices"][0]["index"] for ch in roles) == [0, 1, 2]
    assert all(ch["choices"][0]["delta"]["role"] == "assistant" for ch in roles)
    assert all(ch["usage"] is not None for ch in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 9


def test_penalties_and_room(http):
    base = {"prompt": [5, 6, 7, 5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    plain = http.post("/v1/completions", json=base).json()["choices"][0]["token_ids"]
    banned = http.post("/v1/completions", json={**base, "logit_bias": {str(plain[0]): -100}}).json()
    assert plain[0] not in banned["choices"][0]["token_ids"]
    r = http.post("/v1/completions", json={**base, "presence_penalty": 2.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty"
    r = http.post("/v1/completions", json={**base, "max_tokens": 5000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens" and "5000" in err["message"]
    assert "4096" in err["message"] and "6 tokens" in err["message"]
    # chat without max_tokens may use all the room the prompt leaves
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": None,
                                                "temperature": 0})
    assert r.status_code == 200


def test_tokenize_detokenize_version_and_model_retrieve(http):
    r = http.post("/tokenize", json={"prompt": "hello", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == 5 and r["token_strs"] == list("hello")
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hello"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    r = http.post("/detokenize", json={"tokens": [10 ** 7]})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
    assert http.get("/version").json()["version"]
    m = http.get(f"/v1/models/{MODEL}").json()
    assert m["id"] == MODEL and m["object"] == "model"
    assert http.get("/v1/models/nope").status_code == 404


def test_rejected_requests_are_counted(http):
    def rejected():
        line = [ln for ln in http.get("/metrics").text.splitlines() if ln.startswith("hylo_requests_rejected_total")]
        return float(line[0].split()[1])

    before = rejected()
    for bad in ({"prompt": "x", "n": 0}, {"prompt": "x", "seed": 1 << 64}, {"prompt": "x", "bogus": 1}):
        assert http.post("/v1/completions", json=bad).status_code == 400
    assert rejected() == before + 3


def test_a_request_asks_for_at_most_4096_completions(http):
    """prompts x n past the limit is a 400 naming the count (300000 prompts in one request held every other
    request back for minutes); at the limit it is served."""
    from hylo.server.protocol import MAX_CHOICES

    r = http.post("/v1/completions", json={"prompt": ["ab"] * (MAX_CHOICES // 4 + 1), "n": 4, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and f"= {MAX_CHOICES + 4} completions" in err["message"]
    r = http.post("/v1/completions", json={"prompt": [[5, 6]] * 8, "n": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 16


def test_echo_with_max_tokens_zero_scores_the_prompt_only(http):
    """lm-eval-harness's loglikelihood request: echo, logprobs, max_tokens 0: the prompt's tokens and their log
    probabilities, nothing generated; the same values as the prompt part of an echo that generates."""
    body = {"prompt": [5, 6, 7, 8, 9], "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0,
            "return_tokens_as_token_ids": True}
    r = http.post("/v1/completions", json=body).json()
    c = r["choices"][0]
    assert r["usage"]["completion_tokens"] == 0 and c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in body["prompt"]] and lp["token_logprobs"][0] is None
    gen = http.post("/v1/completions", json={**body, "max_tokens": 2, "ignore_eos": True}).json()["choices"][0]
    assert gen["logprobs"]["token_logprobs"][:5] == lp["token_logprobs"]
    r = http.post("/v1/completions", json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def _sse(http, path, body):
    import json as _json

    with http.stream("POST", path, json={**body, "stream": True}) as s:
        return [_json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]


def test_vllm_response_conventions(http):
    """What vLLM's clients read: top_logprobs dicts that hold the chosen token (logprobs 0: only it), stop_reason,
    the extra fields present as null when not asked for, streamed text offsets equal to the full response's,
    prompt_token_ids on a stream's first chunk, usage only with include_usage."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    r = http.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
    lp = r["logprobs"]
    assert [list(t) for t in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    assert [t[k] for t, k in zip(lp["top_logprobs"], lp["tokens"])] == lp["token_logprobs"]
    assert r["stop_reason"] is None and r["token_ids"] is None and r["prompt_logprobs"] is None
    assert r["prompt_token_ids"] is None
    # sampled tokens outside the top 1 still appear in their dict, beside the top one
    r3 = http.post("/v1/completions", json={**body, "logprobs": 1, "temperature": 2.0}).json()["choices"][0]
    for tok, top in zip(r3["logprobs"]["tokens"], r3["logprobs"]["top_logprobs"]):
        assert tok in top and 1 <= len(top) <= 2
    # a stop string is the stop_reason
    plain = http.post("/v1/completions", json={**body, "prompt": "abc", "return_tokens_as_token_ids": False,
                                               "temperature": 0}).json()["choices"][0]["text"]
    assert len(plain) >= 2
    stopped = http.post("/v1/completions", json={**body, "prompt": "abc", "temperature": 0,
                                                 "stop": [plain[1:2]]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == plain[1:2]
    # streamed echo with logprobs: the same tokens, values and offsets as the full response
    full = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 2,
                                              "return_tokens_as_token_ids": False}).json()["choices"][0]
    chunks = _sse(http, "/v1/completions", {**body, "echo": True, "logprobs": 2, "return_tokens_as_token_ids": False,
                                            "return_token_ids": True})
    got = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for ch in chunks:
        for c in ch["choices"]:
            for k in got:
                got[k] += (c["logprobs"] or {}).get(k, [])
    assert got == {k: full["logprobs"][k] for k in got}
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == full["text"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == body["prompt"]
    assert all("prompt_token_ids" not in c for ch in chunks[1:] for c in ch["choices"])
    assert all("usage" not in ch for ch in chunks)
    # continuous usage needs include_usage (vLLM's rule)
    chunks = _sse(http, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in ch for ch in chunks)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "return_token_ids": True}
    chunks = _sse(http, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] and all("prompt_token_ids" not in ch for ch in chunks[1:])
    full = http.post("/v1/chat/completions", json={**chat, "return_token_ids": False}).json()
    assert full["prompt_token_ids"] is None and full["prompt_logprobs"] is None
    assert full["choices"][0]["token_ids"] is None and "stop_reason" in full["choices"][0]


def test_vllm_request_rules(http):
    r = http.post("/v1/completions", json={"prompt": "ab", "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = http.post("/v1/completions", json={"prompt": "ab", "logit_bias": {"x": 1, "-3": 1, "4": 1}})
    err = r.json()["error"]
    assert r.status_code == 400 and "'x'" in err["message"] and "'-3'" in err["message"]
    r = http.post("/v1/completions", json={"prompt": "ab", "logit_bias": {"--5": 1, "5-": 1, "": 1}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "logit_bias" and "'--5'" in err["message"]
    assert "not token ids" in err["message"] and "'5-'" in err["message"]
    r = http.post("/v1/completions", json={"prompt": "ab", "logit_bias": {"1": 1, "99999": 1, "88888": 1}})
    err = r.json()["error"]
    assert r.status_code == 400 and "88888" in err["message"] and "99999" in err["message"]
    assert "out of vocabulary" in err["message"] and err["param"] == "logit_bias"
    # checked before a stream starts: a 400 naming the field, not a 200 carrying an error event per choice
    for path, base in (("/v1/completions", {"prompt": "ab"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]})):
        for field, value in (("logit_bias", {"99999": 1}), ("stop_token_ids", [5, 10 ** 6])):
            r = http.post(path, json={**base, field: value, "stream": True, "n": 2, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, field, r.text)
    r = http.post("/tokenize", json={"prompt": "hi"}).json()
    assert r["token_strs"] is None
    # prompt_logprobs 0: each prompt token (after the first) with its rank in the vocabulary, as vLLM gives it
    ids = [5, 6, 7, 8, 9]
    r = http.post("/v1/completions", json={"prompt": ids, "prompt_logprobs": 0, "max_tokens": 1}).json()
    entries = r["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for tok, entry in zip(ids[1:], entries[1:]):
        assert list(entry) == [str(tok)] and isinstance(entry[str(tok)]["rank"], int) and entry[str(tok)]["rank"] >= 1


def test_a_response_too_large_to_build_is_refused_and_a_large_one_is_built_off_the_event_loop(http, monkeypatch):
    """A few kilobytes of request can ask for gigabytes of log probabilities (many echoed prompts, n choices, 20
    alternatives): past ``MAX_LOGPROB_ENTRIES`` it is a 400 naming logprobs; a stream, which holds none, is not
    refused. A whole response is formatted in a worker thread, not on the event loop every other client shares."""
    import threading

    from hylo.server import serving

    body = {"prompt": [[5] * 100] * 20, "n": 50, "echo": True, "logprobs": 20, "max_tokens": 1}
    r = http.post("/v1/completions", json=body)  # 20 x 50 x (100 + 1) x 21 entries
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert "2121000 entries" in r.json()["error"]["message"]
    # a chat response carries its prompt's log probabilities once, whatever n: 21 x 1000 entries, not x 100
    chat = {"messages": [{"role": "user", "content": "ab" * 500}], "n": 100, "max_tokens": 1,
            "prompt_logprobs": 20}
    assert serving.MAX_LOGPROB_ENTRIES < 21 * 1000 * 100
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and len(r.json()["choices"]) == 100, r.text
    threads = {}
    choice, new_id = serving._choice, serving.new_id
    monkeypatch.setattr(serving, "new_id", lambda *a: threads.setdefault("loop", threading.get_ident()) and new_id(*a))
    monkeypatch.setattr(serving, "_choice",
                        lambda *a: threads.setdefault("build", threading.get_ident()) and choice(*a))
    r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "echo": True, "logprobs": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 5
    assert threads["build"] != threads["loop"]


def test_constraints_compile_in_threads_of_their_own(http, monkeypatch):
    """A request's constraint compiles in the constraint pool's threads, not in the shared pool that encodes every
    request's prompt (a burst of slow compiles, each up to its time limit, would otherwise stall every client)."""
    import threading

    names = []
    compile_constraint = Engine.compile_constraint
    monkeypatch.setattr(Engine, "compile_constraint",
                        lambda self, c: names.append(threading.current_thread().name) or compile_constraint(self, c))
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[a-c]{2}"}})
    assert r.status_code == 200 and names and names[0].startswith("hylo-constraint"), (r.text, names)
