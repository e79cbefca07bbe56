"""The OpenAI-compatible server, as a real process on a loopback port, driven by the official ``openai`` client and
raw HTTP: completions, chat, streaming, n > 1, stop strings, seeds, 32 concurrent streams with disconnects and bad
requests mixed in, API keys, error objects, the served OpenAPI schema, and a bounded load test."""

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

KEY = "sk-hylo-test"
MODEL = "hylo-default-random"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    cmd = [sys.executable, "-m", "hylo", "serve", "--model", MODEL, "--port", str(port), "--api-key", KEY,
           "--max-num-seqs", "16",
           "--log-level", "warning", "--max-body-bytes", str(1 << 20)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("server did not start")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def _wait_healthy(proc, url, timeout=120.0) -> None:
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None and time.time() < deadline, "server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)


def _metrics(url) -> dict:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait_idle(url, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = _metrics(url)
        if m["hylo_requests_running"] == 0 and m["hylo_requests_waiting"] == 0 and m["hylo_request_slots_used"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {m}")


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{server}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # the key is checked before the body: a malformed one is still a 401 without it
        r = httpx.post(f"{server}/v1/completions", headers={**headers, "Content-Type": "application/json"},
                       content=b"{bad")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                        "Content-Type": "application/json"}, content=b"{bad")
    assert r.status_code == 400
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_completion_and_chat(client):
    out = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len("def fibonacci(n):".encode())
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "hello"}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    # the same request streamed gives the same text, then the usage chunk
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"},
                                                                   {"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_token_prompts_n_and_seeds(client):
    out = client.completions.create(model=MODEL, prompt=[[72, 105], [100, 101, 102]], max_tokens=5, n=3,
                                    temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 30
    again = client.completions.create(model=MODEL, prompt=[[72, 105], [100, 101, 102]], max_tokens=5, n=3,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts[:3])) > 1  # the n choices of one prompt differ
    other = client.completions.create(model=MODEL, prompt=[[72, 105], [100, 101, 102]], max_tokens=5, n=3,
                                      temperature=1.0, seed=8, extra_body={"ignore_eos": True})
    assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    printable = [m.group(0) for m in re.finditer(r"[ -~]{2}", full[4:])]
    stop = printable[0] if printable else full[6:8]
    expected = full[:full.find(stop)]
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=[stop, "\x00zz"],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == expected
    stream = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_bad_requests_get_error_objects(server):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
        (b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
        (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
        (json.dumps({"prompt": [1, 2, 10 ** 6]}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "y" * 5000}).encode(), 400, "prompt"),
        (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "x", "n": 0}).encode(), 400, "n"),
        (json.dumps({"prompt": "x", "logprobs": 21}).encode(), 400, "logprobs"),
        (json.dumps({"prompt": "x", "response_format": {"type": "json_schema"}}).encode(), 400, "response_format"),
        (json.dumps({"prompt": "x", "use_beam_search": True}).encode(), 400, "use_beam_search"),
        (json.dumps({"prompt": "x", "stop_regex": ["a+"]}).encode(), 400, "stop_regex"),
        (json.dumps({"prompt": "x", "frobnicate": 1}).encode(), 400, "frobnicate"),
        (json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}).encode(), 400, "stream_options"),
        (json.dumps({"prompt": "x", "logit_bias": {"abc": 1}}).encode(), 400, "logit_bias"),
        (json.dumps({"prompt": "x", "max_tokens": 10 ** 6}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "model"),
        (json.dumps({"prompt": "x" * (2 << 20)}).encode(), 413, None),
    ]
    for body, status, param in cases:
        r = httpx.post(f"{server}/v1/completions", content=body, headers=h, timeout=30)
        assert r.status_code == status, (body[:60], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param, (body[:60], err)
    # the key is checked first: an oversized body without it is a 401, not a 413 (nothing of it read)
    big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server}/v1/completions", content=big, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": []}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}, headers=h)
    assert r.status_code == 400
    assert httpx.get(f"{server}/v1/nope", headers=h).status_code == 404
    # still serving
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, headers=h)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_32_concurrent_streams_with_disconnects_and_bad_requests(server):
    async def good(client, i):
        n = 4 + i % 9
        stream = await client.completions.create(model=MODEL, prompt=f"request {i}:", max_tokens=n, temperature=0.7,
                                                 seed=i, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
            if c.usage:
                usage = c.usage
        return n, usage.completion_tokens

    async def quitter(i):
        body = {"prompt": f"leaving {i}", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", f"{server}/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {KEY}"}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break  # leave mid-stream
        return seen

    async def bad(i):
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": -i},
                                headers={"Authorization": f"Bearer {KEY}"})
        return r.status_code

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
        jobs = [good(client, i) for i in range(32)] + [quitter(i) for i in range(4)] + [bad(i) for i in range(1, 5)]
        return await asyncio.gather(*jobs)

    before = _metrics(server)
    results = asyncio.run(main())
    for n, got in results[:32]:
        assert got == n
    assert all(s >= 3 for s in results[32:36])
    assert results[36:] == [400] * 4
    m = _wait_idle(server)  # the quitters' requests were aborted and their slots freed
    assert m['hylo_requests_finished_total{reason="abort"}'] - before['hylo_requests_finished_total{reason="abort"}'] >= 4
    assert m["hylo_generation_tokens_total"] - before["hylo_generation_tokens_total"] >= sum(r[0] for r in results[:32])
    assert m["hylo_time_to_first_token_seconds_count"] > before["hylo_time_to_first_token_seconds_count"]


def test_openapi_schema_validates_the_requests(server):
    jsonschema = pytest.importorskip("jsonschema")
    spec = httpx.get(f"{server}/openapi.json").json()
    paths = spec["paths"]

    def schema_for(path):
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return {**ref, "components": spec["components"]}

    completion, chat = schema_for("/v1/completions"), schema_for("/v1/chat/completions")
    accepted = [
        (completion, {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0, "stop": ["a"], "n": 2}),
        (completion, {"prompt": [[1, 2], [3]], "stream": True, "stream_options": {"include_usage": True},
                      "seed": 1, "top_k": 5, "top_p": 0.9}),
        (chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        (chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stream": True}),
    ]
    h = {"Authorization": f"Bearer {KEY}"}
    for schema, body in accepted:
        jsonschema.validate(body, schema)
        path = "/v1/completions" if schema is completion else "/v1/chat/completions"
        plain = {k: v for k, v in body.items() if k != "stream_options"}  # only allowed with stream: true
        r = httpx.post(f"{server}{path}", json={**plain, "stream": False, "max_tokens": 2}, headers=h)
        assert r.status_code == 200, r.text
    for schema, body in [(completion, {"prompt": 5}), (chat, {"messages": "hi"}), (completion, {"max_tokens": 2})]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(body, schema)


def test_bounded_load_test(server):
    from hylo.server.load_test import run_load

    report = asyncio.run(run_load(server, num_requests=24, concurrency=8, max_tokens=8, api_key=KEY))
    assert report["succeeded"] == 24 and not report["errors"]
    assert report["output_tokens"] == 24 * 8
    assert report["requests_per_s"] > 0
    lat = report["latency_s"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
    assert report["ttft_s"]["p50"] <= lat["p50"]
    _wait_idle(server)


def test_non_streaming_client_that_leaves_frees_its_slot(server):
    before = _metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json={"prompt": "long", "max_tokens": 4000, "ignore_eos": True},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=httpx.Timeout(30, read=0.5))
    m = _wait_idle(server, timeout=10)  # well before the 4000 tokens would have been generated
    assert m['hylo_requests_finished_total{reason="abort"}'] == before['hylo_requests_finished_total{reason="abort"}'] + 1


def test_speculative_server_reports_accept_length():
    """With --speculative, outputs are the plain server's (greedy) and /metrics reports the accept length."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "hylo", "serve", "--model", MODEL, "--port", str(port),
                             "--speculative", "ngram", "--num-speculative-tokens", "3", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(proc, url)
        from hylo import LLM, SamplingParams

        prompt = "abcabcabcabcabcabc"
        ref = LLM(MODEL, verbose=False).generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)[0]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60).json()
        assert r["choices"][0]["text"] == ref.text and r["usage"]["completion_tokens"] == 24
        m = _metrics(url)
        assert m["hylo_spec_verify_steps_total"] > 0 and 1.0 <= m["hylo_spec_accept_length"] <= 4.0
        # every token came from a prefill, a verify or a plain step (the adaptive policy's fallback)
        assert m["hylo_spec_emitted_tokens_total"] + m["hylo_spec_plain_steps_total"] == 24 - 1
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_clients_that_leave_leave_no_tracebacks_in_the_log():
    """Non-streaming and streaming clients that disconnect: their requests are aborted, and the server's log has
    no traceback and no 'never retrieved' task once it stops."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "hylo", "serve", "--model", MODEL, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, url)
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3000, "ignore_eos": True},
                           timeout=httpx.Timeout(30, read=0.3))
            with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                              json={"prompt": "y", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break
        _wait_idle(url, timeout=20)
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]


def test_official_client_reads_logprobs_models_and_usage(client):
    """The openai client parses what hylo sends: completions and chat log probabilities, models.retrieve, cached
    prompt tokens in usage."""
    out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0, logprobs=2,
                                    echo=True, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len("def f(x):".encode()) + 4
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and out.choices[0].text.startswith("def f(x):")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2 and isinstance(content[0].bytes, list)
    first = client.completions.create(model=MODEL, prompt=[7, 8, 9, 10, 11], max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = first.choices[0].model_extra["token_ids"]  # vLLM's return_token_ids, an extra field for the client
    nxt = client.completions.create(model=MODEL, prompt=[7, 8, 9, 10, 11] + ids + [12], max_tokens=2, temperature=0)
    assert nxt.usage.prompt_tokens_details.cached_tokens == 5 + 3 - 1  # the first turn, its last token excepted
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
