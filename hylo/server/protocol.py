"""The OpenAI-compatible request and response shapes, and their translation to hylo's SamplingParams.

The request models are what FastAPI validates and what the served OpenAPI schema describes. Fields the OpenAI API
has but hylo does not implement are accepted at their neutral values (what clients send by default) and rejected
with a clear error otherwise, so a request never silently means something else than it says.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

from ..sampling_params import INT64_MAX, INT64_MIN, SamplingParams, wrap_int64


def _no_coercion(value):
    """Numbers as JSON numbers only: pydantic would otherwise read ``true`` as 1 and ``"5"`` as 5, a request
    meaning something other than it says (``5.0`` stays an integer's valid spelling, as in JSON Schema)."""
    if isinstance(value, (bool, str)):
        raise ValueError(f"expected a number, got {json.dumps(value)}")
    return value


Number = BeforeValidator(_no_coercion)
Float = Annotated[float, Number]
Bool = StrictBool  # true or false, not "yes" or 1
# Every integer a client sends is bounded here, at the edge: an unbounded one (a seed of 2**63, say) would otherwise
# reach an int64 device table inside the engine. Pydantic's error names the field and the bound (a 400).
Int64 = Annotated[int, Number, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Number, Field(ge=0, le=INT64_MAX)]
TopN = Annotated[int, Number, Field(ge=0, le=20)]  # alternatives per token (OpenAI's bound)
TokenId = Annotated[int, Number]  # checked against the vocabulary by the engine

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# The most completions one request may ask for (prompts x n): each is an engine request, all queued at once, so a
# request of 300000 short prompts (2.4 MB) held every later request back for minutes
MAX_CHOICES = 4096


class APIError(Exception):
    """An error that becomes an OpenAI-style error object with this HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: Bool = False
    continuous_usage_stats: Bool = Field(False, description="vLLM extension: usage in every chunk")


# Fields of OpenAI's and vLLM's request schemas that hylo does not implement, with the values that mean "not used":
# a request that sets one to anything else is refused by name (a 400), never silently served without it.
NOT_IMPLEMENTED = {
    "guided_decoding_backend": lambda v: v is None,
    "use_beam_search": lambda v: v in (None, False), "length_penalty": lambda v: v in (None, 1, 1.0),
    "stop_regex": lambda v: not v, "continue_final_message": lambda v: v in (None, False),
    "tools": lambda v: not v, "tool_choice": lambda v: v in (None, "none"), "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"), "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "min_p": lambda v: v in (None, 0, 0.0), "truncate_prompt_tokens": lambda v: v is None,
    "include_stop_str_in_output": lambda v: v in (None, False), "skip_special_tokens": lambda v: v in (None, True),
    "spaces_between_special_tokens": lambda v: v in (None, True), "chat_template": lambda v: v is None,
    "documents": lambda v: not v, "add_special_tokens": lambda v: v in (None, False), "suffix": lambda v: not v,
    "reasoning_effort": lambda v: v is None, "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None, "prediction": lambda v: v is None, "web_search_options": lambda v: v is None,
    "bad_words": lambda v: not v, "allowed_token_ids": lambda v: v is None,
}
# accepted and without effect on the output (OpenAI's bookkeeping fields), each of its JSON type (or null)
IGNORED = {"user": str, "store": bool, "metadata": dict, "service_tier": str, "request_id": str, "priority": int}
_JSON_TYPE = {str: "a string", bool: "true or false", dict: "an object", int: "an integer"}


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Annotated[int, Number, Field(ge=-1, le=INT64_MAX)] | None = Field(
        None, description="vLLM extension: sample from the k most likely tokens (0 or -1: all)")
    seed: Int64 | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[Count] | None = Field(None, description="vLLM extension: token ids that end the output")
    ignore_eos: Bool = Field(False, description="vLLM extension: keep going past the end-of-sequence token")
    min_tokens: Count = Field(0, description="vLLM extension: no stop before this many tokens")
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = Field(None, description="vLLM extension: divide the logits of tokens seen "
                                                                "in the prompt or output (1: none)")
    logit_bias: dict[str, Float] | None = None
    prompt_logprobs: TopN | None = Field(
        None, description="vLLM extension: the prompt tokens' log probabilities and this many alternatives")
    return_token_ids: Bool = Field(False, description="vLLM extension: each choice's token_ids and its prompt's "
                                                      "prompt_token_ids in the response")
    return_tokens_as_token_ids: Bool = Field(False, description="vLLM extension: logprob tokens as 'token_id:ID'")
    n: Annotated[int, Number, Field(ge=1, le=128)] = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    # output constraints (server/structured.py reads them): OpenAI's, vLLM's, vLLM's older names
    response_format: dict | None = None
    structured_outputs: dict | None = Field(None, description="vLLM extension: one of json, regex, choice, "
                                                              "grammar, json_object")
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_fields(self) -> None:
        """Refuse what hylo does not implement, by name: unknown fields and the not-implemented ones set."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                kind = IGNORED[name]
                if value is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
                    raise APIError(f"{name} must be {_JSON_TYPE[kind]}", param=name)
                continue
            if name in NOT_IMPLEMENTED:
                if not NOT_IMPLEMENTED[name](value):
                    raise APIError(f"{name} is not supported by hylo", param=name, code="unsupported_parameter")
                continue
            raise APIError(f"unknown field {name!r}", param=name, code="unknown_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise APIError("prompt_logprobs is not available with stream: true", param="prompt_logprobs")

    def logprobs_n(self) -> int | None:
        """How many alternatives per generated token the request wants (None: no log probabilities)."""
        raise NotImplementedError

    def choice_params(self, default_max_tokens: int, constraint=None) -> list[SamplingParams]:
        """Sampling parameters for each of the ``n`` choices (a seeded request gives choice i the seed + i, so
        that the choices differ and the whole response is reproducible), with the output ``constraint``."""
        self.check_fields()
        return [self._sampling_params(default_max_tokens, i, constraint) for i in range(self.n)]

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out, not_ids, out_of_range = {}, [], []
        for key, value in self.logit_bias.items():
            tok = int(key) if re.fullmatch(r"\s*-?[0-9]{1,18}\s*", key, re.ASCII) else None
            if tok is None or tok < 0:
                not_ids.append(key)
            elif not (math.isfinite(value) and -100 <= value <= 100):
                out_of_range.append(f"{key!r}: {value}")
            else:
                out[tok] = float(value)
        if not_ids:
            shown = [k if len(k) <= 24 else k[:21] + "..." for k in not_ids[:8]]
            raise APIError(f"logit_bias: keys {shown} are not token ids", param="logit_bias")
        if out_of_range:
            raise APIError(f"logit_bias: values must be between -100 and 100, got {', '.join(out_of_range[:8])}",
                           param="logit_bias")
        return out

    def output_limit(self) -> tuple[str, int | None]:
        """(the field that limits the output's length, its value): ``max_completion_tokens`` where given (OpenAI's
        newer name), else ``max_tokens``; None where neither is."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def _sampling_params(self, default_max_tokens: int, n_index: int, constraint=None) -> SamplingParams:
        limit_field, max_tokens = self.output_limit()
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise APIError(f"{name} must be a finite number, got {value}", param=name)
        if self.temperature is not None and self.temperature > 2.0 + 1e-9:
            raise APIError(f"temperature must be between 0 and 2, got {self.temperature}", param="temperature")
        try:
            return SamplingParams(
                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                seed=None if self.seed is None else wrap_int64(self.seed + n_index),
                stop=self.stop if self.stop != [] else None,  # "" is refused by name, as [""] is
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self._logit_bias(),
                logprobs=self.logprobs_n(),
                prompt_logprobs=self.prompt_logprobs_n(),
                constraint=constraint,
            )
        except ValueError as e:
            msg = str(e)
            param = msg.split(" ", 1)[0].split("[", 1)[0].rstrip(":")
            if param == "max_tokens" and limit_field != param:  # the field the client set, by its own name
                msg, param = msg.replace("max_tokens", limit_field, 1), limit_field
            if param == "min_tokens" and max_tokens is None and "must not exceed" in msg:  # a default it never set
                msg = (f"min_tokens ({self.min_tokens}) is more than the {default_max_tokens} tokens that "
                       f"{limit_field} (not given) comes to here")
            raise APIError(msg, param=param) from None

    def prompt_logprobs_n(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    echo: Bool = False
    best_of: Annotated[int, Number] | None = None
    logprobs: TopN | None = None

    def logprobs_n(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_n(self) -> int | None:
        # echo with logprobs scores the prompt too
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list:
        """The prompts, each a string or a list of token ids."""
        self.check_fields()
        if self.best_of not in (None, 1, self.n):
            raise APIError("best_of is not supported by hylo", param="best_of", code="unsupported_parameter")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            if len(p) * self.n > MAX_CHOICES:  # each is a request of the engine's, queued before any other's
                raise APIError(f"this request asks for {len(p)} prompts x n={self.n} = {len(p) * self.n} "
                               f"completions; at most {MAX_CHOICES} per request: send the rest in further requests",
                               param="prompt")
            return [x if isinstance(x, str) else list(x) for x in p]
        raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                       param="prompt")


class ContentPart(BaseModel):
    """One part of a message's content. Only text is served: other kinds (``image_url``, ``input_audio``,
    ``video_url``, ``file``) are accepted by the schema so that the refusal can name them (``text_of``)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to one

    def text(self, index: int = 0) -> str:
        """The message's text; a part that is not text is a clear error (never silently dropped)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            where = f"messages[{index}].content[{j}]"
            if part.type != "text":
                raise APIError(f"{where}: {part.type!r} content is not supported: hylo serves the text model only "
                               f"(images, audio and video are not supported yet)", param="messages",
                               code="unsupported_content")
            if part.text is None:
                raise APIError(f"{where}: a text part needs 'text'", param="messages")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: Bool = False
    top_logprobs: TopN | None = None
    add_generation_prompt: Bool = Field(True, description="vLLM extension: end the prompt with the assistant's turn")
    chat_template_kwargs: dict | None = Field(None, description="vLLM extension: extra variables for the chat "
                                                                "template (e.g. enable_thinking)")
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Bool | None = None

    def logprobs_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def rendered_messages(self) -> list[dict]:
        self.check_fields()
        out = []
        for i, m in enumerate(self.messages):
            msg = {"role": m.role, "content": m.text(i)}
            if m.tool_calls:
                msg["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


def _template_call(call: dict, index: int) -> dict:
    """An assistant message's earlier tool call for the chat template: its arguments as an object (templates
    write them with tojson), as OpenAI's clients send them (a JSON string)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"messages[{index}].tool_calls: each call needs function.name", param="messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise APIError(f"messages[{index}].tool_calls: arguments of {fn['name']!r} are not valid JSON",
                           param="messages") from None
    return {**call, "function": {"name": fn["name"], "arguments": args}}


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or chat messages rendered with the chat template first."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: Bool = True
    add_special_tokens: Bool | None = Field(None, description="add the tokenizer's special tokens (e.g. BOS); "
                                                              "default: yes for a prompt, no for messages")
    return_token_strs: Bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Int64]


# ---- responses -------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens reused from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
