"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Every request is validated completely (fields, prompts, context limit) before anything reaches the engine, so a
bad request gets an OpenAI-style error object and costs the others nothing. A client that goes away (mid-stream
or while waiting for a full response) has its requests aborted at once, which frees their slots.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import Engine
from .engine_thread import Delta, EngineThread
from .metrics import Metrics
from .protocol import (DEFAULT_COMPLETION_MAX_TOKENS, APIError, ChatCompletionRequest, CompletionRequest, error_body,
                       new_id, now, usage)

DEFAULT_MAX_BODY_BYTES = 4 << 20


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, by Content-Length or while reading a chunked body."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._reject(send)
        if length is not None:
            return await self.app(scope, receive, send)
        # no length given (chunked): read the body here, refusing it as soon as it passes the limit, then replay it
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await self._reject(send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send):
        body = json.dumps(error_body(f"request body is larger than the limit of {self.limit} bytes",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(engine: Engine, api_key: str | None = None, served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    metrics = Metrics()
    runner = EngineThread(engine, metrics)
    model_name = served_model_name or engine.model_name

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="hylo", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible API of the hylo inference engine")
    app.state.runner, app.state.metrics = runner, metrics

    # ---- errors ---------------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        err = errors[0] if errors else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            message = f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
            param = None
        else:
            param = loc[0] if loc else None  # the request field (deeper parts name union members, not fields)
            where = ".".join(x for x in loc if x.isdigit() or x == param or not any(c in x for c in "[]-,")) or param
            message = f"{where}: {err.get('msg', 'invalid value')}" if param else err.get("msg", "invalid request")
            alternatives = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1]]
            if len(alternatives) > 1 and any(len(e.get("loc", ())) > 2 for e in alternatives):
                message = f"{param}: has the wrong type or value (e.g. {err.get('msg', 'invalid value')})"
        return JSONResponse(error_body(message, param=param, code=err.get("type")), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), code=code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"), status_code=500)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", status=401,
                           code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(f"the model {name!r} does not exist; this server serves {model_name!r}", status=404,
                           param="model", code="model_not_found")

    # ---- endpoints ------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not runner.alive:
            return JSONResponse({"status": "error", "detail": "the engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hylo",
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = [_encode(engine, p) for p in body.prompts()]
        params = body.choice_params(DEFAULT_COMPLETION_MAX_TOKENS)
        return await _serve(request, runner, "cmpl", "text_completion", model_name, prompts, params, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer, which chat needs", param="messages")
        try:
            text = engine.tokenizer.apply_chat_template(body.rendered_messages(), add_generation_prompt=True)
        except APIError:
            raise
        except Exception as e:  # a template may raise on messages it does not accept
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
        prompt = _encode(engine, text)
        params = body.choice_params(engine.max_model_len)
        return await _serve(request, runner, "chatcmpl", "chat.completion", model_name, [prompt], params, body,
                            chat=True)

    if max_body_bytes:
        app.add_middleware(BodyLimit, limit=max_body_bytes)
    return app


def _version() -> str:
    from .. import __version__

    return __version__


def _encode(engine: Engine, prompt) -> list[int]:
    try:
        return engine.encode_prompt(prompt)
    except ValueError as e:
        msg = str(e)
        code = "context_length_exceeded" if "context limit" in msg else None
        raise APIError(msg, param="prompt", code=code) from None


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


async def _serve(request: Request, runner: EngineThread, id_prefix: str, obj: str, model: str,
                 prompts: list[list[int]], params: list, body, chat: bool):
    """Submit one request per (prompt, choice) and answer with one response or a stream."""
    rid = new_id(id_prefix)
    created = now()
    jobs = [(i * len(params) + j, prompt, p) for i, prompt in enumerate(prompts) for j, p in enumerate(params)]
    queues = {index: runner.submit(f"{rid}-{index}", prompt, p) for index, prompt, p in jobs}
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(runner, rid, created, model, obj, queues, prompt_tokens, include_usage, chat,
                                         len(params)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    collect = asyncio.ensure_future(asyncio.gather(*(_collect(q) for q in queues.values())))
    collect.add_done_callback(_retrieved)
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    watcher.add_done_callback(_retrieved)
    try:
        await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server gave up on the handler (the client went away, or shutdown)
        _abandon(runner, rid, queues, collect)
        raise
    finally:
        watcher.cancel()
    if not collect.done():  # the client left: free its slots now
        _abandon(runner, rid, queues, collect)
        return JSONResponse(error_body("client disconnected"), status_code=499)
    results = collect.result()
    failed = [r for r in results if r.error]
    if failed:
        for index in queues:
            runner.abort(f"{rid}-{index}")
        worst = max(failed, key=lambda r: r.status)
        raise APIError(worst.error, status=worst.status,
                       type="server_error" if worst.status >= 500 else "invalid_request_error")
    choices = []
    for index, r in zip(queues, results):
        if chat:
            choice = {"index": index, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                      "finish_reason": r.finish_reason}
        else:
            choice = {"index": index, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
            if body.return_token_ids:
                choice["prompt_token_ids"] = prompts[index // len(params)]
        if body.return_token_ids:
            choice["token_ids"] = r.token_ids
        choices.append(choice)
    completion_tokens = sum(r.completion_tokens for r in results)
    # each prompt counts once (its first choice), as prompt_tokens does
    cached = sum(r.cached_tokens for index, r in zip(queues, results) if index % len(params) == 0)
    response = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached)}
    if chat and body.return_token_ids:
        response["prompt_token_ids"] = prompts[0]
    return response


def _retrieved(future: asyncio.Future) -> None:
    """A done callback that takes a finished task's exception, so that none is logged as 'never retrieved'."""
    if not future.cancelled():
        future.exception()


def _abandon(runner: EngineThread, rid: str, queues: dict, collect: asyncio.Future) -> None:
    """Stop waiting for a response nobody will read, and free its requests' slots."""
    collect.cancel()
    for index in queues:
        runner.abort(f"{rid}-{index}")


async def _collect(q: asyncio.Queue) -> Delta:
    total = Delta()
    while True:
        d: Delta = await q.get()
        total.text += d.text
        total.token_ids += d.token_ids
        total.completion_tokens = d.completion_tokens or total.completion_tokens
        total.cached_tokens = d.cached_tokens or total.cached_tokens
        if d.error:
            total.error, total.status = d.error, d.status
            return total
        if d.finish_reason is not None:
            total.finish_reason = d.finish_reason
            return total


async def _stream(runner: EngineThread, rid: str, created: int, model: str, obj: str, queues: dict,
                  prompt_tokens: int, include_usage: bool, chat: bool, choices_per_prompt: int):
    """Server-sent events in OpenAI's chunk format; aborts every unfinished choice if the client goes away."""
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(index, q):
        while True:
            d = await q.get()
            await merged.put((index, d))
            if d.error or d.finish_reason is not None:
                return

    chunk_obj = obj + ".chunk" if chat else obj
    tasks = [asyncio.ensure_future(forward(i, q)) for i, q in queues.items()]
    open_choices = set(queues)
    completion_tokens = cached = 0

    def chunk(choices, extra=None):
        data = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": choices}
        if include_usage:
            data["usage"] = None
        data.update(extra or {})
        return f"data: {json.dumps(data)}\n\n"

    try:
        if chat:  # the role comes first, as OpenAI sends it
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in queues])
        while open_choices:
            index, d = await merged.get()
            if d.error:
                kind = "server_error" if d.status >= 500 else "invalid_request_error"
                yield f"data: {json.dumps(error_body(d.error, type=kind))}\n\n"
                open_choices.discard(index)
                continue
            if d.finish_reason is not None:
                open_choices.discard(index)
                completion_tokens += d.completion_tokens
                cached += d.cached_tokens if index % choices_per_prompt == 0 else 0
            if d.text or d.finish_reason is not None:
                if chat:
                    delta = {"content": d.text} if d.text else {}
                    yield chunk([{"index": index, "delta": delta, "logprobs": None,
                                  "finish_reason": d.finish_reason}])
                else:
                    yield chunk([{"index": index, "text": d.text, "logprobs": None,
                                  "finish_reason": d.finish_reason}])
        if include_usage:
            yield chunk([], {"usage": usage(prompt_tokens, completion_tokens, cached)})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for index in open_choices:  # the client went away mid-stream: free the slots now
            runner.abort(f"{rid}-{index}")
