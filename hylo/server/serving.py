"""Serving one completions or chat request: its choices submitted to the engine thread, then one response or a
stream of chunks in OpenAI's shapes, log probabilities included. A client that goes away has its requests aborted
at once (their slots freed), and no task of it is left with an exception nobody reads."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .engine_thread import Delta, EngineThread
from .protocol import APIError, error_body, new_id, now, usage
from .tools import CallStream, parse_calls

NEG_INF_LOGPROB = -9999.0  # a log probability of -inf, as JSON can carry it (vLLM's convention)


class Echo(NamedTuple):
    """An echoed prompt's text (completions with ``echo``): the prompt string as given (``verbatim``: special
    tokens written in it stay), or the decoded ids of a token-id prompt (without special tokens)."""

    text: str
    verbatim: bool


class TextCursor:
    """Where a completion's next token starts in its text, in characters (``text_offset``): a character counts
    once its last byte has come, so the tokens that hold the bytes of one character split between them all point
    at it. One per choice, carried across a stream's chunks."""

    def __init__(self):
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def offset(self, data: bytes) -> int:
        """Where a token of bytes ``data`` starts: past the characters so far, and past the replacement
        characters that bytes left pending before it become where its first byte cannot continue them (an invalid
        sequence's U+FFFD belongs to the token that held it, not to the next)."""
        pending = self._utf8.getstate()[0]
        if pending and (not data or data[0] & 0xC0 != 0x80):
            return self.chars + len(pending.decode("utf-8", errors="replace"))
        return self.chars

    def advance(self, data: bytes) -> None:
        self.chars += len(self._utf8.decode(data))


class Formatter:
    """Token strings and log-probability objects for one request's responses."""

    def __init__(self, tokenizer, as_ids: bool):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def token(self, token_id: int) -> str:
        """The token's text; a token that is not whole UTF-8 (part of a character) as OpenAI writes one,
        ``bytes:\\xNN...``, so that such tokens stay apart (as ``top_logprobs`` keys too)."""
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def token_bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return b""
        return self.tokenizer.token_bytes(token_id)

    @staticmethod
    def value(lp: float) -> float:
        return max(lp, NEG_INF_LOGPROB)

    def chat(self, token_ids: list[int], lps: list) -> dict:
        """``choices[].logprobs`` of a chat response (or chunk)."""
        content = []
        for tok, lp in zip(token_ids, lps):
            content.append({"token": self.token(tok), "logprob": self.value(lp.logprob),
                            "bytes": list(self.token_bytes(tok)),
                            "top_logprobs": [{"token": self.token(t), "logprob": self.value(v),
                                              "bytes": list(self.token_bytes(t))} for t, v in lp.top]})
        return {"content": content}

    def completion(self, token_ids: list[int], lps: list, cursor: TextCursor, verbatim: int = 0) -> dict:
        """``choices[].logprobs`` of a completions response (or chunk), ``cursor`` moved past it: ``lps``
        entries may be None (an echoed prompt's first token). Each ``top_logprobs`` dict holds the top
        alternatives and the chosen token (OpenAI's rule: up to logprobs + 1 entries). ``text_offset`` counts the
        characters of the response's text: special tokens take none (the text is decoded without them), except
        in the first ``verbatim`` tokens (an echoed prompt string, which holds them as written)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        specials = getattr(self.tokenizer, "special_ids", set())
        for i, (tok, lp) in enumerate(zip(token_ids, lps)):
            text = self.token(tok)
            out["tokens"].append(text)
            own = i < verbatim or tok not in specials  # the token has characters of its own (``text`` may be its id)
            data = self.token_bytes(tok) if own else b""
            out["text_offset"].append(cursor.offset(data) if own else cursor.chars)
            if own:
                cursor.advance(data)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(self.value(lp.logprob))
                top = {self.token(t): self.value(v) for t, v in lp.top}
                top.setdefault(text, self.value(lp.logprob))
                out["top_logprobs"].append(top)
        return out

    def prompt(self, prompt_ids: list[int], lps: list) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {id: {logprob, rank, decoded_token}}
        for the token itself and the top alternatives (rank: its place in the vocabulary, 1 the most likely)."""
        out = []
        for tok, lp in zip(prompt_ids, lps):
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): {"logprob": self.value(v), "rank": r + 1, "decoded_token": self.token(t)}
                     for r, (t, v) in enumerate(lp.top)}
            entry.setdefault(str(tok), {"logprob": self.value(lp.logprob), "rank": lp.rank,
                                        "decoded_token": self.token(tok)})
            out.append(entry)
        return out


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


def _retrieved(future: asyncio.Future) -> None:
    """A done callback that takes a finished task's exception, so that none is logged as 'never retrieved'."""
    if not future.cancelled():
        future.exception()


def _abandon(runner: EngineThread, rid: str, queues: dict, collect: asyncio.Future) -> None:
    """Stop waiting for a response nobody will read, and free its requests' slots."""
    collect.cancel()
    for index in queues:
        runner.abort(f"{rid}-{index}")


@dataclasses.dataclass
class Reply:
    """What shapes an answer, beside its results: the endpoint's ids and object name, the request's body, and
    ``echo_texts``: the prompts' texts, returned before each choice's completion (completions with ``echo``);
    ``score_only``: the requests generate one token that the answer leaves out (echo with max_tokens 0: the prompt
    scored only); ``tools`` (chat, ``server.tools.Tools``): the model's tool calls parsed out of its text."""

    id_prefix: str  # "cmpl", "chatcmpl"
    obj: str  # "text_completion", "chat.completion"
    model: str
    body: Any
    chat: bool
    fmt: Formatter
    echo_texts: list[Echo] | None = None
    score_only: bool = False
    tools: Any = None


async def serve(request: Request, runner: EngineThread, reply: Reply, prompts: list[list[int]], params: list,
                rooms: list[int] | None = None):
    """Submit one request per (prompt, choice) and answer with one response or a stream (``reply``); ``rooms``: per
    prompt, the most tokens its outputs may take (a default max_tokens within the room the prompt leaves)."""
    body, chat, fmt, obj, model = reply.body, reply.chat, reply.fmt, reply.obj, reply.model
    rid = new_id(reply.id_prefix)
    created = now()
    jobs = [(i * len(params) + j, prompt, p if rooms is None or p.max_tokens <= rooms[i]
             else dataclasses.replace(p, max_tokens=rooms[i]))
            for i, prompt in enumerate(prompts) for j, p in enumerate(params)]
    if not body.stream:  # (a stream sends its entries as they come, holding none)
        _check_logprob_volume(reply, prompts, jobs)
    queues = {index: runner.submit(f"{rid}-{index}", prompt, p) for index, prompt, p in jobs}
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        return StreamingResponse(_stream(runner, rid, created, reply, queues, prompts, len(params)),
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
    if reply.score_only:
        results = [_scored_only(r) for r in results]
    failed = [r for r in results if r.error]
    if failed:
        for index in queues:
            runner.abort(f"{rid}-{index}")
        worst = max(failed, key=lambda r: r.status)
        raise APIError(worst.error, status=worst.status,
                       type="server_error" if worst.status >= 500 else "invalid_request_error")

    def build() -> JSONResponse:
        n = len(params)
        choices = []
        for index, r in zip(queues, results):
            echo = reply.echo_texts[index // n] if reply.echo_texts else None
            choices.append(_choice(index, r, prompts[index // n], reply, echo))
        completion_tokens = sum(r.completion_tokens for r in results)
        # each prompt counts once (its first choice), as prompt_tokens does
        cached = sum(r.cached_tokens for index, r in zip(queues, results) if index % n == 0)
        response = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                    "usage": usage(prompt_tokens, completion_tokens, cached)}
        if chat:  # vLLM's fields, null when not asked for
            response["prompt_token_ids"] = prompts[0] if body.return_token_ids else None
            response["prompt_logprobs"] = (fmt.prompt(prompts[0], results[0].prompt_logprobs or [])
                                           if body.prompt_logprobs is not None else None)
        return JSONResponse(response)
    # formatted and encoded in a worker thread: tens of megabytes of log probabilities would otherwise hold the
    # event loop, and every other client's stream, for seconds
    return await run_in_threadpool(build)


# The most log-probability entries (a token's own, and each alternative) one response may hold: each takes about 200
# bytes in the server before it is sent, so this bounds a response at about 400 MB (a request of a few kilobytes
# could otherwise ask for tens of gigabytes: thousands of echoed prompts, n choices each, 20 alternatives a token).
MAX_LOGPROB_ENTRIES = 2_000_000


def _check_logprob_volume(reply: Reply, prompts: list[list[int]], jobs) -> None:
    """A 400 for a request whose log probabilities (every choice's output up to an output limit it gave, and the
    scored prompts': each completion choice carries its prompt's, a chat response its one prompt's once) pass
    ``MAX_LOGPROB_ENTRIES``. (Without a limit, a chat's default is the room its prompt leaves, which a long-context
    model's output rarely fills: not counted.)"""
    body = reply.body
    top, prompt_top = body.logprobs_n(), body.prompt_logprobs_n()
    if top is None and prompt_top is None:
        return
    entries = 0
    if top is not None and (body.output_limit()[1] is not None or not reply.chat):  # (a completion's default: 16)
        entries += (top + 1) * sum(p.max_tokens for _, _, p in jobs)
    if prompt_top is not None:
        entries += (prompt_top + 1) * (len(prompts[0]) if reply.chat else sum(len(prompt) for _, prompt, _ in jobs))
    if entries > MAX_LOGPROB_ENTRIES:
        raise APIError(f"the log probabilities asked for (every choice's tokens, the prompts' too where scored, with "
                       f"their alternatives) come to {entries} entries, more than the {MAX_LOGPROB_ENTRIES} one "
                       f"response may hold: ask for fewer alternatives, choices, prompts or tokens",
                       param="logprobs")


def _choice(index: int, r: Delta, prompt: list[int], reply: Reply, echo: Echo | None) -> dict:
    """One choice of a whole (not streamed) response; ``echo``: its prompt's text before its own (completions)."""
    body, chat, fmt, tools = reply.body, reply.chat, reply.fmt, reply.tools
    want_lp = body.logprobs_n() is not None
    if chat:
        message, finish = {"role": "assistant", "content": r.text}, r.finish_reason
        if tools is not None:
            content, calls = parse_calls(r.text, tools)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = tools.finish_reason(finish)
        choice = {"index": index, "message": message,
                  "logprobs": fmt.chat(r.token_ids, r.logprobs) if want_lp else None,
                  "finish_reason": finish, "stop_reason": r.stop_reason}
    else:
        text, ids, lps, verbatim = _with_echo(echo, prompt, r.text, r.token_ids, r.logprobs or [], r.prompt_logprobs)
        lp = fmt.completion(ids, lps, TextCursor(), verbatim) if want_lp else None
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": r.finish_reason,
                  "stop_reason": r.stop_reason,
                  "prompt_logprobs": fmt.prompt(prompt, r.prompt_logprobs or [])
                  if body.prompt_logprobs is not None else None,
                  "prompt_token_ids": prompt if body.return_token_ids else None}
    choice["token_ids"] = r.token_ids if body.return_token_ids else None
    return choice


def _with_echo(echo: Echo | None, prompt: list[int], text: str, ids: list[int], lps: list, prompt_lps):
    """A completion's text, token ids and log probabilities with its prompt before them where it echoes (``echo``),
    and how many leading tokens are the prompt as the client sent it (``verbatim``, see ``Formatter``)."""
    if echo is None:
        return text, ids, lps, 0
    return (echo.text + text, prompt + ids, (prompt_lps or [None] * len(prompt)) + lps,
            len(prompt) if echo.verbatim else 0)


def _scored_only(d: Delta) -> Delta:
    """A delta without what its request generated (echo with max_tokens 0): the prompt's part only."""
    d.text, d.token_ids, d.logprobs, d.completion_tokens = "", [], [], 0
    if d.finish_reason is not None:
        d.finish_reason = "length"
    return d


async def _collect(q: asyncio.Queue) -> Delta:
    total = Delta()
    while True:
        d: Delta = await q.get()
        total.text += d.text
        total.token_ids += d.token_ids
        total.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            total.prompt_logprobs = d.prompt_logprobs
        total.completion_tokens = d.completion_tokens or total.completion_tokens
        total.stop_reason = d.stop_reason if d.stop_reason is not None else total.stop_reason
        total.cached_tokens = d.cached_tokens or total.cached_tokens
        if d.error:
            total.error, total.status = d.error, d.status
            return total
        if d.finish_reason is not None:
            total.finish_reason = d.finish_reason
            return total


async def _stream(runner: EngineThread, rid: str, created: int, reply: Reply, queues: dict,
                  prompts: list[list[int]], choices_per_prompt: int):
    """Server-sent events in OpenAI's chunk format; aborts every unfinished choice if the client goes away.
    A completions choice's first chunk carries its echoed prompt (with the prompt's log probabilities, which
    come with the first token) and, with return_token_ids, its prompt_token_ids."""
    body, chat, fmt, model, obj = reply.body, reply.chat, reply.fmt, reply.model, reply.obj
    echo_texts, score_only, tools = reply.echo_texts, reply.score_only, reply.tools
    merged: asyncio.Queue = asyncio.Queue()
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and opts.continuous_usage_stats
    want_lp = body.logprobs_n() is not None
    prompt_tokens = sum(len(p) for p in prompts)

    async def forward(index, q):
        while True:
            d = await q.get()
            await merged.put((index, d))
            if d.error or d.finish_reason is not None:
                return

    chunk_obj = obj + ".chunk" if chat else obj
    tasks = [asyncio.ensure_future(forward(i, q)) for i, q in queues.items()]
    for t in tasks:
        t.add_done_callback(_retrieved)
    open_choices = set(queues)
    started: set[int] = set()  # choices whose first chunk went out
    completion = {i: 0 for i in queues}
    cached = {i: 0 for i in queues}
    cursors = {i: TextCursor() for i in queues}  # text_offset of the choice's next token
    calls_of = {i: CallStream(tools) for i in queues} if tools is not None else None  # chat with tools

    def chat_delta(index: int, d: Delta) -> tuple[dict, str | None]:
        """A chat chunk's delta and finish reason; with tools, the text from a (possible) call's start held back
        until the choice ends, then parsed into tool_calls (``tools.CallStream``)."""
        if tools is None:
            return ({"content": d.text} if d.text else {}), d.finish_reason
        if d.finish_reason is None:
            out = calls_of[index].feed(d.text)
            return ({"content": out} if out else {}), None
        content, calls = calls_of[index].finish(d.text)
        delta = {"content": content} if content else {}
        if not calls:
            return delta, d.finish_reason
        delta["tool_calls"] = [dict(c, index=j) for j, c in enumerate(calls)]
        return delta, tools.finish_reason(d.finish_reason)

    def current_usage():
        done = sum(completion.values())
        return usage(prompt_tokens, done, sum(v for i, v in cached.items() if i % choices_per_prompt == 0))

    def chunk(choices, extra=None):
        data = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": choices}
        if include_usage:
            data["usage"] = current_usage() if continuous else None
        data.update(extra or {})
        return f"data: {json.dumps(data)}\n\n"

    def completion_choice(index: int, d: Delta) -> dict:
        prompt = prompts[index // choices_per_prompt]
        first = index not in started
        echo = echo_texts[index // choices_per_prompt] if first and echo_texts else None
        text, ids, lps, verbatim = _with_echo(echo, prompt, d.text, d.token_ids, d.logprobs, d.prompt_logprobs)
        lp = None
        if want_lp and ids:
            lp = fmt.completion(ids, lps, cursors[index], verbatim)
        c = {"index": index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
             "stop_reason": d.stop_reason}
        if body.return_token_ids:
            c["token_ids"] = d.token_ids
            if first:
                c["prompt_token_ids"] = prompt
        return c

    try:
        if chat:  # each choice's role first, in a chunk of its own, as OpenAI sends them
            for i in queues:
                extra = {"prompt_token_ids": prompts[0]} if body.return_token_ids and i == min(queues) else None
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], extra)
        while open_choices:
            index, d = await merged.get()
            if score_only:
                d = _scored_only(d)
            completion[index] = d.completion_tokens or completion[index]
            cached[index] = d.cached_tokens or cached[index]
            if d.error:
                kind = "server_error" if d.status >= 500 else "invalid_request_error"
                yield f"data: {json.dumps(error_body(d.error, type=kind))}\n\n"
                open_choices.discard(index)
                continue
            if d.finish_reason is not None:
                open_choices.discard(index)
            if d.text or d.token_ids or d.finish_reason is not None or (not chat and index not in started):
                if chat:
                    delta, finish = chat_delta(index, d)
                    c = {"index": index, "delta": delta,
                         "logprobs": fmt.chat(d.token_ids, d.logprobs) if want_lp and d.token_ids else None,
                         "finish_reason": finish, "stop_reason": d.stop_reason}
                    if body.return_token_ids:
                        c["token_ids"] = d.token_ids
                    elif not delta and finish is None and c["logprobs"] is None:
                        continue  # text held back (a possible tool call): nothing to send yet
                else:
                    c = completion_choice(index, d)
                started.add(index)
                yield chunk([c])
        if include_usage:
            yield chunk([], {"usage": current_usage()})
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for index in open_choices:  # the client went away mid-stream: free the slots now
            runner.abort(f"{rid}-{index}")
