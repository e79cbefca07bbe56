"""The shared nouns: sampling parameters, requests, forward modes and the forward batch.

Everything below the engine imports these and nothing above them, so that no backend or model ever needs to import
the scheduler to know what a batch is.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's bound)
# A temperature below this samples greedily (vLLM's bound too): logits divided by 1e-39 overflow float32 to inf,
# and the draw would return garbage; at 1e-5 a sample differs from the argmax only between exact ties anyway.
GREEDY_BELOW = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # below 0.01 a penalized logit grows past any sane scale (1e-39: inf)


# ---------------------------------------------------------------------------------------------------------------
# Sampling parameters
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature == 0`` is greedy (so is any temperature below ``GREEDY_BELOW``, 1e-5). ``top_k <= 0`` (or -1)
    and ``top_p == 1`` disable those filters. ``seed`` makes the sample reproducible whatever else runs in the same
    batch. ``stop`` strings end the output before the match (the match itself is not returned); ``stop_token_ids``
    end it after the token (also not returned in ``text``).

    The logits are changed before temperature, top-k and top-p, in this order: ``logit_bias`` (token id -> added
    value, in [-100, 100]), ``min_tokens`` (the stop tokens are masked until that many tokens were generated),
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


# ---------------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------------
class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Req:
    """One request as the scheduler tracks it.

    ``num_computed`` counts the tokens of ``prompt_ids + output_ids`` whose KV and recurrent state are in the
    caches, as far as the host knows; the next step feeds the tokens after it. ``req_slot`` / ``state_slot`` are -1
    while the request holds no slot (waiting or preempted).

    The ``inflight*`` fields describe launched steps whose results the host has not read yet (the overlap loop runs
    one step ahead): how many, how many tokens they commit at most (exactly, unless a verify is among them) and how
    many output tokens they produce at least. ``decoding`` says the last launched row sampled, so the next row feeds
    the newest token, which only the device tables know until the results arrive.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed (its SamplingParams.seed, or one drawn by the engine)
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    req_slot: int = -1
    state_slot: int = -1
    num_computed: int = 0
    num_kv: int = 0  # positions with a reserved KV location (>= num_computed: reserved ahead)
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    arrival: int = 0  # admission order; the newest running request is preempted first
    kv_locs: list[torch.Tensor] = field(default_factory=list)  # host copies of its KV locations, for freeing
    # the prompt as a host int64 tensor, made when the request arrives (a prefill chunk slices it instead of
    # converting thousands of Python ints before its first kernel)
    prompt_tensor: torch.Tensor | None = field(default=None, repr=False)
    decoding: bool = False
    inflight: int = 0
    inflight_advance: int = 0
    inflight_verify: int = 0
    inflight_new: int = 0
    release_deferred: bool = False  # finished or preempted while in flight: free its slots when the step completes
    spec: "SpecStats | None" = None
    has_drafts: bool = False  # the last launched step of this request drafted for the next (speculative decoding)
    # incremental detokenisation state (see engine/detok.py)
    text: str = ""
    detok_prefix: int = 0
    detok_read: int = 0
    # set when the engine failed this request (an internal error in a step it was part of); it then finishes with
    # finish_reason "abort" and the requests beside it go on
    error: str | None = None
    # prefix caching (cache/prefix_cache.py): positions [0, prefix_len) use KV locations the cache owns (the request
    # holds a lock on ``cache_node``, where they end) and ``kv_locs`` holds the request's own from prefix_len on;
    # ``state_len`` counts the tokens its state slot reflects (every completed step's commits, also after the
    # request finished); ``extra_ids`` the tokens such late steps committed that never reached ``output_ids``
    prefix_len: int = 0
    cache_node: object = None
    state_len: int = 0
    extra_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens reused from the cache at admission
    # params.constraint compiled on arrival: a constrain.automaton.TokenAutomaton, or for a grammar the request's
    # own constrain.host.HostMatcher
    automaton: object = None
    last_snapshot: int = 0  # position of this request's latest snapshot
    branch_point: int = 0  # where its tokens leave the cached ones: a prefill chunk ends there, with a snapshot
    use_prefix_cache: bool = True  # False: neither reuses nor adds (Engine.prompt_logits computes every position)
    logprobs: list["TokenLogprobs"] = field(default_factory=list)  # one per output token, when asked for
    prompt_logprobs: list["TokenLogprobs | None"] = field(default_factory=list)  # per prompt token, when asked for

    @property
    def host_matched(self) -> bool:
        """Its constraint is matched on the host (a grammar): each step needs the token before it."""
        return getattr(self.automaton, "host", False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def token_tensor(self, start: int, end: int) -> torch.Tensor:
        """``tokens(start, end)`` as a host int64 tensor (a view of ``prompt_tensor`` inside the prompt)."""
        if end <= len(self.prompt_ids):
            if self.prompt_tensor is None:
                self.prompt_tensor = torch.tensor(self.prompt_ids, dtype=torch.int64)
            return self.prompt_tensor[start:end]
        return torch.tensor(self.tokens(start, end), dtype=torch.int64)

    def known_tokens(self, end: int) -> list[int]:
        """The first ``end`` tokens this request computed: prompt, output, then what late steps committed."""
        out = self.prompt_ids + self.output_ids
        if end > len(out):
            out = out + self.extra_ids
        return out[:end]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    @property
    def computed_bound(self) -> int:
        """Tokens in the caches once the in-flight steps complete (an upper bound while a verify is in flight)."""
        return self.num_computed + self.inflight_advance


# ---------------------------------------------------------------------------------------------------------------
# Forward batch
# ---------------------------------------------------------------------------------------------------------------
class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill chunks (decode rows may ride along with one token each)
    DECODE = "decode"  # one token per request
    TARGET_VERIFY = "target_verify"  # last token + k drafts per request; states go to the verify buffers
    DRAFT_DECODE = "draft_decode"
    DRAFT_EXTEND = "draft_extend"

    @property
    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)

    @property
    def is_decode(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE)


@dataclass
class ForwardBatch:
    """Everything one forward pass needs, passed explicitly down the call chain (no global context).

    Device tensors are indexed by batch row (``[B]``) or by token (``[T]``). Host-side fields are upper bounds or
    facts the scheduler already knows; none of them is ever read back from the device.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_slots: torch.Tensor  # [B] int64, 0 for padded rows
    state_slots: torch.Tensor  # [B] int64, -1 for padded rows
    seq_lens: torch.Tensor  # [B] int64, tokens in the cache after this pass (prefix + new)
    query_start_loc: torch.Tensor  # [B + 1] int64, row b's tokens are [qsl[b], qsl[b+1])
    out_cache_loc: torch.Tensor  # [T] int64, KV pool location of every new token
    max_seq_len: int  # host upper bound of seq_lens (sizes the attention gather)
    # Host facts for EXTEND: the scheduler decided the chunk sizes, so it knows them without a device read.
    extend_lens_cpu: list[int] | None = None
    prefix_lens_cpu: list[int] | None = None
    req_slots_cpu: list[int] | None = None
    state_slots_cpu: list[int] | None = None
    seq_lens_cpu: torch.Tensor | None = None  # only when some backend needs it (none of ours does)
    # EXTEND, on the device: every token's row, and the last fed token and the row of every sampling row
    token_rows: torch.Tensor | None = None  # [T] int64
    sample_idx: torch.Tensor | None = None  # [S] int64
    sample_rows: torch.Tensor | None = None  # [S] int64
    num_padding: int = 0  # padded rows at the tail (CUDA graph replay)
    tokens_per_row: int = 1  # DECODE: 1; TARGET_VERIFY: k + 1

    @property
    def batch_size(self) -> int:
        return int(self.req_slots.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the device, plus host flags that pick which work is needed at all."""

    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, vocab size when disabled
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, index of the output token being sampled (keys the per-request noise)
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    slots: torch.Tensor | None = None  # [B] the rows' request slots (the penalty tables' rows)
    penalized: bool = False  # some row's logits change before sampling (ops.logits.apply_penalties)
    constrained: bool = False  # some row's tokens are constrained (constrain.tables: masks from device states)
    logprobs: int | None = None  # the most alternatives a row asked for; None: no row wants log probabilities


# ---------------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    """Speculative decoding counters of one request."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens produced by verify steps (accepted drafts + one bonus per step)
    plain_steps: int = 0  # steps that decoded one token without drafts (the adaptive policy's fallback)
    # drafts accepted per verify, a running estimate (engine/spec_policy.py); None before the first verify
    accept_estimate: float | None = None

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per verify step, the bonus token included."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "plain_steps": self.plain_steps, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "mean_accept_length": self.mean_accept_length}


@dataclass
class TokenLogprobs:
    """One token's log probability under the model's raw distribution, and the most likely alternatives there:
    ``top`` is a list of (token id, log probability), most likely first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One sample of a prompt (``SamplingParams.n`` of them in ``RequestOutput.outputs``)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    """What a request produced so far (``finished`` tells whether it is complete). The flat fields are its first
    sample; ``outputs`` holds every one (``SamplingParams.n`` of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str | None  # None without a tokenizer
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    finished: bool
    stop_reason: int | str | None = None
    spec: SpecStats | None = None
    num_preemptions: int = 0
    error: str | None = None  # an internal error ended this request (finish_reason "abort"); see Req.error
    num_cached_tokens: int = 0  # prompt tokens whose KV and state came from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, with SamplingParams(logprobs=N)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (the first: None)
    outputs: list[CompletionOutput] = field(default_factory=list)

    def __post_init__(self):
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.token_ids, self.text, self.finish_reason, self.stop_reason,
                                             self.logprobs)]


# ---------------------------------------------------------------------------------------------------------------
# Host-to-device copies
# ---------------------------------------------------------------------------------------------------------------
def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The host tensor ``t`` on ``device`` without making the host wait for the device. On CUDA the bytes go
    through a pinned copy, CUDA's documented asynchronous path: from pageable memory the driver may make the copy
    wait for the stream to drain, which in the overlap loop would hold the launch of step N+1 until step N had
    finished. (On the H200 host this driver did not, after its first such copy: ``tools/h2d_check.py``, 0.02 ms
    for the call behind 50 ms of queued work; the pinned copy costs the host a few microseconds more.)"""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return pin(t).to(device, non_blocking=True)


def pin(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of the host tensor ``t``, from torch's caching host allocator, which reuses the block only
    after the copies that read it (events it records) have completed."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
