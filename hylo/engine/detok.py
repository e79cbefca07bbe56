"""Incremental detokenisation: append only the text that the newest tokens make certain.

Decoding token by token breaks multi-byte characters and tokenizers that merge across tokens, so each step decodes
a short window ``output_ids[prefix:]`` and compares it with the window up to the last emitted token. Text ending in
U+FFFD is an unfinished character and waits for the next token.
"""

from __future__ import annotations

from ..core import Req


def detokenize_step(tokenizer, req: Req) -> str:
    """Extend ``req.text`` with the text of ``output_ids`` not yet emitted; returns the new text."""
    ids = req.output_ids
    if len(ids) <= req.detok_read:
        return ""
    before = tokenizer.decode(ids[req.detok_prefix:req.detok_read])
    now = tokenizer.decode(ids[req.detok_prefix:])
    if now.endswith("\ufffd"):
        return ""
    delta = now[len(before):]
    req.detok_prefix = req.detok_read
    req.detok_read = len(ids)
    req.text += delta
    return delta


def find_stop_string(req: Req, delta: str) -> tuple[int, str] | None:
    """The earliest stop string that the newest text completes: (its position in req.text, the string)."""
    stops = req.params.stop_strings
    if not stops or not delta:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(req.text) - len(delta) - longest + 1)
    best = None
    for s in stops:
        pos = req.text.find(s, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def settled_length(req: Req) -> int:
    """How much of ``req.text`` is final: all of it once the request finished, else all but what a stop string
    could still claim (its longest length less one, from the end), which a stream holds back."""
    text, stops = req.text or "", req.params.stop_strings
    if req.finished or not stops:
        return len(text)
    return max(0, len(text) - max(len(s) for s in stops) + 1)
