"""The OpenAI-compatible request and response shapes, and their translation to hylo's SamplingParams.

The request models are what FastAPI validates and what the served OpenAPI schema describes. Fields the OpenAI API
has but hylo does not implement are accepted at their neutral values (what clients send by default) and rejected
with a clear error otherwise, so a request never silently means something else than it says.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..core import INT64_MAX, INT64_MIN, SamplingParams

# Every integer a client sends is bounded here, at the edge: an unbounded one (a seed of 2**63, say) would otherwise
# reach an int64 device table inside the engine. Pydantic's error names the field and the bound (a 400).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = Field(
        None, description="hylo extension: sample from the k most likely tokens (0 or -1: all)")
    seed: Int64 | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[Count] | None = Field(None, description="hylo extension: token ids that end the output")
    ignore_eos: bool = Field(False, description="hylo extension: keep going past the end-of-sequence token")
    return_token_ids: bool = Field(False, description="vLLM extension: each choice's token_ids and its prompt's "
                                                      "prompt_token_ids in the response")
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted at their neutral values only
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Union[bool, Annotated[int, Field(ge=0, le=20)], None] = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise APIError(f"{name} is not supported by hylo (only 0)", param=name, code="unsupported_parameter")
        if self.logprobs not in (None, False, 0):
            raise APIError("logprobs are not supported by hylo", param="logprobs", code="unsupported_parameter")
        if self.top_logprobs not in (None, 0):
            raise APIError("top_logprobs is not supported by hylo", param="top_logprobs",
                           code="unsupported_parameter")
        if self.logit_bias:
            raise APIError("logit_bias is not supported by hylo", param="logit_bias", code="unsupported_parameter")

    def choice_params(self, default_max_tokens: int) -> list[SamplingParams]:
        """Sampling parameters for each of the ``n`` choices (a seeded request gives choice i the seed + i, so
        that the choices differ and the whole response is reproducible)."""
        self._check_unsupported()
        return [self._sampling_params(default_max_tokens, i) for i in range(self.n)]

    def _sampling_params(self, default_max_tokens: int, n_index: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
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
                seed=None if self.seed is None else _wrap_int64(self.seed + n_index),
                stop=self.stop or None,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
            )
        except ValueError as e:
            msg = str(e)
            raise APIError(msg, param=msg.split(" ", 1)[0]) from None


def _wrap_int64(value: int) -> int:
    """``value`` wrapped into the int64 range (choice i of a seeded request has seed + i, which may pass the top)."""
    return (value - INT64_MIN) % (1 << 64) + INT64_MIN


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list:
        """The prompts, each a string or a list of token ids."""
        if self.echo:
            raise APIError("echo is not supported by hylo", param="echo", code="unsupported_parameter")
        if self.suffix:
            raise APIError("suffix is not supported by hylo", param="suffix", code="unsupported_parameter")
        if self.best_of not in (None, 1, self.n):
            raise APIError("best_of is not supported by hylo", param="best_of", code="unsupported_parameter")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [list(x) for x in p]
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
    tools: list | None = None

    def rendered_messages(self) -> list[dict]:
        if self.tools:
            raise APIError("tools are not supported by hylo", param="tools", code="unsupported_parameter")
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


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


def openai_finish_reason(reason: str | None) -> str | None:
    """hylo's finish reasons are OpenAI's, plus "abort" (a request ended by the server)."""
    return reason
