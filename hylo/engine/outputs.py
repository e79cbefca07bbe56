"""What a step's results do to a request on the host: its new tokens and the stop rules, its log probabilities
unpacked from the host view's float32 bits, its prompt log probabilities."""

from __future__ import annotations

import torch

from ..core import Req, TokenLogprobs
from .detok import detokenize_step, find_stop_string
from .plan import ScheduledBatch


def append_token(req: Req, token: int, eos_ids: set[int], tokenizer, max_model_len: int) -> str | None:
    """Append one generated token and apply the stop rules: the finish reason ("stop", "length") when the
    request ends with it (its ``stop_reason`` and text set), else None."""
    req.output_ids.append(token)
    p = req.params
    if p.stop_token_ids and token in p.stop_token_ids:  # the stop token's text is not part of the output
        req.stop_reason = token
        return "stop"
    if not p.ignore_eos and token in eos_ids:  # the end of sequence: no stop_reason (vLLM's rule)
        return "stop"
    if tokenizer is not None:
        delta = detokenize_step(tokenizer, req)
        # no stop string ends the output within its first min_tokens tokens (vLLM's rule)
        hit = find_stop_string(req, delta) if len(req.output_ids) > p.min_tokens else None
        if hit is not None:
            req.text = req.text[:hit[0]]
            req.stop_reason = hit[1]
            return "stop"
    if len(req.output_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        if tokenizer is not None:  # flush a character the last token left unfinished
            req.text = tokenizer.decode(req.output_ids)
        return "length"
    return None


def unpack_logprobs(bits: list[int], width: int, top_n: int, wanted: int) -> list[TokenLogprobs]:
    """A row's log probabilities from the host view's float32 bits: per token (its log probability, the ``wanted``
    most likely (id, log probability) pairs)."""
    vals = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).view(width, 1 + 2 * top_n)
    out = []
    for r in vals.tolist():
        top = [(int(r[1 + top_n + j]), r[1 + j]) for j in range(wanted)]
        out.append(TokenLogprobs(r[0], top))
    return out


def apply_prompt_logprobs(sched: ScheduledBatch, values: list[list[float]]) -> None:
    """Each prefill chunk's prompt log probabilities into its request's list (the first prompt token has none:
    nothing precedes it)."""
    at = 0
    spans = sched.prompt_logprob_spans()
    top_n = max((sched.reqs[j].params.prompt_logprobs for j, _, _ in spans), default=0)
    for i, _, count in spans:
        req, wanted = sched.reqs[i], sched.reqs[i].params.prompt_logprobs
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)
        for r in values[at:at + count]:
            req.prompt_logprobs.append(TokenLogprobs(r[0], [(int(r[1 + top_n + j]), r[1 + j])
                                                            for j in range(wanted)], rank=int(r[-1])))
        at += count
