"""What a user asks of one request: ``SamplingParams``, checked when it is made (every bound named in its error),
and the bounds the server's schema shares with it."""

from __future__ import annotations

import math
from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's bound)
# stop strings are searched on the engine's one host thread after every token of every request that has them: their
# number and length bound what one request can make every other wait (OpenAI allows 4)
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 1024
# A temperature below this samples greedily (vLLM's bound too): logits divided by 1e-39 overflow float32 to inf,
# and the draw would return garbage; at 1e-5 a sample differs from the argmax only between exact ties anyway.
GREEDY_BELOW = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # below 0.01 a penalized logit grows past any sane scale (1e-39: inf)


def wrap_int64(value: int) -> int:
    """``value`` wrapped into the int64 range (sample i of a seeded request has seed + i, which may pass the top)."""
    return (value - INT64_MIN) % (1 << 64) + INT64_MIN


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature == 0`` is greedy (so is any temperature below ``GREEDY_BELOW``, 1e-5). ``top_k <= 0`` (or -1)
    and ``top_p == 1`` disable those filters. ``seed`` makes the sample reproducible whatever else runs in the same
    batch, and the same with or without speculative decoding. ``stop`` strings end the output before the match (the
    match itself is not returned); ``stop_token_ids`` end it after the token (also not returned in ``text``).

    The logits are changed before temperature, top-k and top-p, in this order: ``logit_bias`` (token id -> added
    value, in [-100, 100]), ``min_tokens`` (the stop tokens are masked, and stop strings not matched, until that
    many tokens were generated),
    ``repetition_penalty`` (tokens of the prompt or output: a positive logit divided by it, a negative one
    multiplied), ``frequency_penalty`` (minus it times the token's count in the output) and ``presence_penalty``
    (minus it once a token is in the output), OpenAI's and vLLM's formulas. ``logprobs=N`` returns each generated
    token's log probability and the N most likely alternatives, ``prompt_logprobs=N`` the same for the prompt's
    tokens; both from the model's raw distribution (log_softmax of the logits before any change above). ``n``
    (offline API): that many samples of each prompt, choice i seeded with seed + i. ``constraint``
    (``hylo.constrain.spec.Constraint``: a regular expression, a JSON schema, any JSON object, a choice or a
    grammar) allows
    only outputs it matches: the tokens it does not allow are masked after every change above, and the output ends
    (at an end-of-sequence token) only where the constraint may end.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    constraint: "object | None" = None  # constrain.spec.Constraint

    def __post_init__(self):
        self.validate()
        if self.temperature < GREEDY_BELOW:  # greedy: dividing the logits by it would overflow float32
            self.temperature = 0.0

    def validate(self) -> None:
        def _num(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(float(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _num("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _num("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both disable it) or positive, got {self.top_k}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            # the seed is held in an int64 device table: outside that range it cannot be represented
            raise ValueError(f"seed must be between {INT64_MIN} and {INT64_MAX} (a 64-bit integer), got {self.seed}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        stops = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters "
                             f"each, got {len(stops)} of up to {max(len(s) for s in stops)}")
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        for name, low, high in (("min_tokens", 0, None), ("n", 1, 128), ("logprobs", 0, MAX_LOGPROBS),
                                ("prompt_logprobs", 0, MAX_LOGPROBS)):
            value = getattr(self, name)
            if value is None and name in ("logprobs", "prompt_logprobs"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None
                                                                                        and value > high):
                bound = f"between {low} and {high}" if high is not None else f"an integer >= {low}"
                raise ValueError(f"{name} must be {bound}, got {value!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            _num(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        _num("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be between {low} and {high:g}, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to values, got {type(self.logit_bias).__name__}")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise ValueError(f"logit_bias: key {tok!r} is not a token id")
                _num(f"logit_bias[{tok}]", bias)
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias[{tok}] must be between -100 and 100, got {bias}")
        if self.constraint is not None:
            if not hasattr(self.constraint, "kind") or not hasattr(self.constraint, "to_regex"):
                raise ValueError(f"constraint must be a hylo.constrain.spec.Constraint, got "
                                 f"{type(self.constraint).__name__}")
            if self.ignore_eos or self.min_tokens:
                name = "ignore_eos" if self.ignore_eos else "min_tokens"
                raise ValueError(f"{name} cannot be combined with a constraint: the output ends where the "
                                 "constraint is complete")

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling (a bias, a penalty or min_tokens)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
