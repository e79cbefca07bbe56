"""A request's input checked before anything is queued: its prompt's token ids and the token ids its sampling
parameters name. Each check raises a ValueError naming the problem, so a bad request never reaches (or harms) the
requests already running."""

from __future__ import annotations

import numbers

import torch

from ..sampling_params import SamplingParams


class ContextLengthError(ValueError):
    """A prompt, or a prompt and its output limit, longer than the context (OpenAI's ``context_length_exceeded``)."""


def check_room(max_model_len: int, prompt_len: int, max_tokens: int, field: str = "max_tokens") -> None:
    """An output limit (``field``) that the context left after the prompt cannot hold is refused, naming both
    numbers: it is never clamped silently."""
    room = max_model_len - prompt_len
    if max_tokens > room:
        raise ContextLengthError(f"{field} is {max_tokens}, but the prompt has {prompt_len} tokens and the context "
                                 f"limit (max_model_len) is {max_model_len}: at most {room} tokens fit")


def encode_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int,
                  add_special_tokens: bool = True) -> list[int]:
    """Token ids of a prompt (a string or token ids), validated: non-empty, inside the vocabulary, shorter than the
    context limit. ``add_special_tokens``: let the tokenizer add its own (a BOS): not for a rendered chat template,
    which writes them itself."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: pass prompts as lists of token ids")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    elif isinstance(prompt, (list, tuple)) or is_id_vector(prompt):
        ids = prompt.tolist() if is_id_vector(prompt) else list(prompt)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(f"prompt token at position {i} is {t!r}, not an integer token id")
        ids = [int(t) for t in ids]
    else:
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t} at position {i} is out of vocabulary "
                             f"(ids are 0..{vocab_size - 1})")
    if len(ids) >= max_model_len:
        raise ContextLengthError(f"prompt has {len(ids)} tokens, but the context limit (max_model_len) is "
                                 f"{max_model_len}: it must be shorter to leave room for output")
    return ids


def is_id_vector(x) -> bool:
    """A one-dimensional torch tensor or numpy array (token ids as an array rather than a list)."""
    return (isinstance(x, torch.Tensor) or type(x).__module__ == "numpy") and getattr(x, "ndim", None) == 1


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids the parameters name (``stop_token_ids``, ``logit_bias`` keys) past the vocabulary: a ValueError
    starting with the field's name."""
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
        bad = sorted({t for t in ids or () if t >= vocab_size})
        if bad:
            raise ValueError(f"{name}: token ids {bad[:8]} are out of vocabulary (ids are 0..{vocab_size - 1})")
