"""The shared nouns: requests, forward modes, the forward batch and what a request returns.

Everything below the engine imports these and nothing above them, so that no backend or model ever needs to import
the scheduler to know what a batch is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


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
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None at the EOS)
    num_preemptions: int = 0
    kv_locs: list[torch.Tensor] = field(default_factory=list)  # host copies of its KV locations, for freeing
    # the prompt as a host int64 tensor, made when the request arrives (a prefill chunk slices it instead of
    # converting thousands of Python ints before its first kernel)
    prompt_tensor: torch.Tensor | None = field(default=None, repr=False)
    decoding: bool = False
    decoded_state: bool = False  # its state slot holds tokens a decode or verify step computed (not a prefill)
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
    # set when the engine failed this request (an internal error in a step it was part of, status 500, or the
    # request's own fault found while serving it, such as a grammar the matcher gave up on, status 400); it then
    # finishes with finish_reason "abort" and the requests beside it go on
    error: str | None = None
    error_status: int = 500
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
    generated_rows_cpu: list[bool] | None = None  # rows feeding generated tokens, not a prompt's (plan.generated)
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
    ``top`` is a list of (token id, log probability), most likely first; ``rank``: the token's place in the whole
    vocabulary (1: the most likely), for a prompt token (None for a sampled one)."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


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
    error: str | None = None  # an error ended this request (finish_reason "abort"); see Req.error
    error_status: int = 500  # 500: the engine's fault (logged with its traceback); 400: the request's own
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


def host_tensor_to(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host values (a list, or nested lists) as a tensor on ``device``, by ``to_device``."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def pin(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of the host tensor ``t``, from torch's caching host allocator, which reuses the block only
    after the copies that read it (events it records) have completed."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
