"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Every request is validated completely (fields, prompts, context limit) before anything reaches the engine, so a
bad request gets an OpenAI-style error object and costs the others nothing. A client that goes away (mid-stream
or while waiting for a full response) has its requests aborted at once, which frees their slots.
"""

from __future__ import annotations

import json
import secrets
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import Engine
from ..engine.intake import ContextLengthError, check_room
from ..tokenizer import CHATML_TEMPLATE, ChatTemplateError
from .engine_thread import EngineThread
from .metrics import Metrics
from .protocol import (DEFAULT_COMPLETION_MAX_TOKENS, APIError, ChatCompletionRequest, CompletionRequest,
                       DetokenizeRequest, TokenizeRequest, error_body)
from .serving import Echo, Formatter, Reply, serve
from .structured import compile_constraint, constraint_of
from .tools import Tools, parse_tools

DEFAULT_MAX_BODY_BYTES = 4 << 20


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, by Content-Length or while reading a chunked body."""

    def __init__(self, app, limit: int, api_key: str | None = None):
        self.app, self.limit, self.api_key = app, limit, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._reject(send, scope)
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
                return await self._reject(send, scope)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send, scope):
        status, body = 413, error_body(f"request body is larger than the limit of {self.limit} bytes",
                                       code="request_too_large")
        if not key_matches(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"), self.api_key):
            status, body = 401, error_body(INVALID_KEY, code="invalid_api_key")  # the key first, as for any request
        body = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


INVALID_KEY = "invalid or missing API key (send 'Authorization: Bearer <key>')"


def key_matches(header: str, api_key: str | None) -> bool:
    """Whether an Authorization header carries the server's API key (always, where the server has none)."""
    if api_key is None:
        return True
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


def check_api_key(api_key: str | None) -> None:
    """An API key clients can send and that keeps others out: not empty (``Bearer`` with nothing after it would
    match), printable ASCII (HTTP headers carry no other text reliably), no spaces around it (they are trimmed)."""
    if api_key is None:
        return
    if not api_key or api_key != api_key.strip() or not (api_key.isascii() and api_key.isprintable()):
        raise ValueError("--api-key must be a non-empty key of printable ASCII characters without spaces around it")


def create_app(engine: Engine, api_key: str | None = None, served_model_name: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    check_api_key(api_key)
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
        if exc.status not in (401, 403) and exc.status < 500:
            metrics.rejected += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        try:  # the key first, as OpenAI checks it: a request without it learns nothing of what its body lacks
            await authorize(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        metrics.rejected += 1
        errors = exc.errors()
        err = dict(errors[0]) if errors else {}
        if isinstance(err.get("msg"), str):  # pydantic's wording of a validator's own ValueError
            err["msg"] = err["msg"].removeprefix("Value error, ")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if err.get("type") == "json_invalid":
            message = f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
            param = None
        elif loc == [] or kind != "application/json" and err.get("type") in ("model_attributes_type", "missing"):
            # no JSON object reached the fields: an empty body, or one sent as another content type
            body = await request.body()
            message = "the request body must be a JSON object"
            if not body:
                message += " (the body is empty)"
            elif kind != "application/json":
                message += f", sent as Content-Type: application/json (got {kind or 'no Content-Type'})"
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
        return JSONResponse(error_body(str(exc.detail), code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))  # (a 405's Allow)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"), status_code=500)

    async def authorize(request: Request) -> None:
        if not key_matches(request.headers.get("authorization", ""), api_key):
            raise APIError(INVALID_KEY, status=401, code="invalid_api_key")

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

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "hylo",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.get("/version")
    async def version():
        return {"version": _version()}

    def tokenizer():
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer", param="model")
        return engine.tokenizer

    def chat_prompt(body: ChatCompletionRequest, tools: Tools | None = None) -> str:
        extra = dict(body.chat_template_kwargs or {})
        taken = sorted(set(extra) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
        if taken:  # the request's own fields set these: a second value would only confuse the template
            raise APIError(f"chat_template_kwargs: {taken[0]!r} is set by the request itself (its own field), not "
                           f"through chat_template_kwargs", param="chat_template_kwargs")
        if tools is not None:
            extra["tools"] = tools.specs
        try:
            return tokenizer().apply_chat_template(body.rendered_messages(),
                                                   add_generation_prompt=body.add_generation_prompt,
                                                   extra=extra)
        except APIError:
            raise
        except ChatTemplateError as e:  # the model's fault: no message could be rendered
            raise APIError(str(e), status=500, type="internal_server_error") from None
        except Exception as e:  # a template may raise on messages it does not accept
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give either 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError("messages must hold at least one message", param="messages")
            text = chat_prompt(ChatCompletionRequest(messages=body.messages,
                                                     add_generation_prompt=body.add_generation_prompt))
        else:
            text = body.prompt
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        try:  # (in a worker thread, as every prompt's encoding: megabytes of text take seconds)
            ids = await run_in_threadpool(tokenizer().encode, text, add_special_tokens=special)
        except ValueError as e:
            raise APIError(str(e), param="messages" if body.messages is not None else "prompt") from None
        strs = [tokenizer().token_piece(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token ids {bad[:8]} are out of vocabulary (ids are 0..{vocab - 1})", param="tokens")
        return {"prompt": tokenizer().decode(body.tokens)}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        raw = body.prompts()
        # encoded in a worker thread: a prompt of megabytes takes seconds, which must not stall every other stream
        prompts = await run_in_threadpool(lambda: [_encode(engine, p) for p in raw])
        # echo with max_tokens 0 scores the prompt and generates nothing (lm-eval-harness's loglikelihood requests):
        # served as one token that the response leaves out
        limit_field, given = body.output_limit()
        score_only = body.echo and given == 0
        if score_only:
            setattr(body, limit_field, 1)
        field, constraint = constraint_of(body)
        params = body.choice_params(DEFAULT_COMPLETION_MAX_TOKENS, constraint)
        _check_token_ids(engine, params[0])
        await compile_constraint(engine, constraint, field)
        for p in prompts:
            _check_room(engine, p, params[0].max_tokens, explicit=given is not None, field=limit_field)
        rooms = None
        if given is None:  # OpenAI's default of 16, within the room each prompt leaves
            rooms = [engine.max_model_len - len(p) for p in prompts]
            for p in prompts:  # which min_tokens must fit as it is
                _check_room(engine, p, params[0].min_tokens, explicit=True, field="min_tokens")
        echo = None
        if body.echo:
            echo = [Echo(p, True) if isinstance(p, str) else
                    Echo(engine.tokenizer.decode(ids) if engine.tokenizer else "", False)
                    for p, ids in zip(raw, prompts)]
        reply = Reply("cmpl", "text_completion", model_name, body, chat=False,
                      fmt=Formatter(engine.tokenizer, body.return_tokens_as_token_ids), echo_texts=echo,
                      score_only=score_only)
        return await serve(request, runner, reply, prompts, params, rooms=rooms)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer, which chat needs", param="messages")
        tools = parse_tools(body, engine.tokenizer.chat_template or CHATML_TEMPLATE)
        # rendered and encoded in a worker thread (as a completion's prompt); the template writes its own specials
        prompt = await run_in_threadpool(lambda: _encode(engine, chat_prompt(body, tools), add_special_tokens=False,
                                                                 field="messages"))
        room = engine.max_model_len - len(prompt)
        limit_field, given = body.output_limit()
        _check_room(engine, prompt, given if given is not None else room, explicit=given is not None,
                    field=limit_field)
        field, constraint = constraint_of(body)
        calls = tools.constraint() if tools is not None else None
        if calls is not None:
            if constraint is not None:
                raise APIError(f"{field} cannot be combined with tool_choice {body.tool_choice!r} (the calls are "
                               f"the output's constraint)", param=field)
            field, constraint = "tools", calls
        params = body.choice_params(room, constraint)  # without max_tokens: the room the prompt leaves
        _check_token_ids(engine, params[0])
        await compile_constraint(engine, constraint, field)
        reply = Reply("chatcmpl", "chat.completion", model_name, body, chat=True,
                      fmt=Formatter(engine.tokenizer, body.return_tokens_as_token_ids), tools=tools)
        return await serve(request, runner, reply, [prompt], params)

    if max_body_bytes:
        app.add_middleware(BodyLimit, limit=max_body_bytes, api_key=api_key)
    return app


def _version() -> str:
    from .. import __version__

    return __version__


def _check_room(engine: Engine, prompt: list[int], max_tokens: int, explicit: bool,
                field: str = "max_tokens") -> None:
    """An output limit (``field``: max_tokens or max_completion_tokens) given explicitly that the context cannot
    hold (``intake.check_room``)."""
    if explicit:
        try:
            check_room(engine.max_model_len, len(prompt), max_tokens, field)
        except ContextLengthError as e:
            raise APIError(str(e), param=field, code="context_length_exceeded") from None


def _check_token_ids(engine: Engine, params) -> None:
    """Token ids the request names past the vocabulary (``Engine.check_token_ids``) are a 400 naming the field
    here, before any response starts (the engine thread would refuse them inside a stream's 200)."""
    try:
        engine.check_token_ids(params)
    except ValueError as e:
        raise APIError(str(e), param=str(e).split(":", 1)[0]) from None


def _encode(engine: Engine, prompt, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
    try:
        return engine.encode_prompt(prompt, add_special_tokens=add_special_tokens)
    except ValueError as e:
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        raise APIError(str(e), param=field, code=code) from None
