"""Per-request-slot tables of the logit processing (penalties, logit bias, min_tokens), on the device.

Allocated the first time a request asks for any of it (``ReqSlots.penalties``): a vocabulary-wide row per request
slot is large (at a 248320-token vocabulary, 2.5 MB per slot for the four tables), and most deployments never use
them. A request's row is written when its prefill starts (``register``) and its output counts grow on the device
with every token it emits (``count``), so a step never builds these from host lists.
"""

from __future__ import annotations

import torch

from ..core import to_device


class PenaltyTables:
    def __init__(self, num_slots: int, vocab: int, device: torch.device):
        rows = num_slots + 1
        self.vocab = vocab
        self.out_counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)  # output tokens so far
        self.in_prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # prompt tokens (repetition)
        self.bias = torch.zeros(rows, vocab, dtype=torch.float32, device=device)  # logit_bias, dense
        self.stop_mask = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # masked until min_tokens
        # presence, frequency, repetition penalties; min_tokens
        self.params = torch.zeros(rows, 3, dtype=torch.float32, device=device)
        self.params[:, 2] = 1.0  # a row nobody registered leaves its logits as they are (repetition 1, not 0)
        self.min_tokens = torch.zeros(rows, dtype=torch.int64, device=device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.out_counts, self.in_prompt, self.bias, self.stop_mask,
                                                         self.params, self.min_tokens))

    def register(self, slot: int, prompt: list[int], output: list[int], params, stop_ids: set[int]) -> None:
        """Write a request's row when its prefill starts (again after a preemption: its output so far counts)."""
        dev = self.out_counts.device
        self.out_counts[slot].zero_()
        self.in_prompt[slot].zero_()
        self.bias[slot].zero_()
        self.stop_mask[slot].zero_()
        if output:
            out = to_device(torch.tensor(output, dtype=torch.int64), dev)
            self.out_counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if prompt:
            self.in_prompt[slot, to_device(torch.tensor(prompt, dtype=torch.int64), dev)] = True
        if params.logit_bias:
            ids = torch.tensor([t for t in params.logit_bias], dtype=torch.int64)
            vals = torch.tensor([float(v) for v in params.logit_bias.values()], dtype=torch.float32)
            self.bias[slot, to_device(ids, dev)] = to_device(vals, dev)
        if params.min_tokens and stop_ids:
            self.stop_mask[slot, to_device(torch.tensor(sorted(stop_ids), dtype=torch.int64), dev)] = True
        self.params[slot] = to_device(torch.tensor([params.presence_penalty, params.frequency_penalty,
                                                    params.repetition_penalty], dtype=torch.float32), dev)
        self.min_tokens[slot] = params.min_tokens

    def count(self, slots: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add emitted tokens to their rows' output counts, on the device: slots [B], tokens [B, W] (``valid``
        [B, W] marks the ones that count: a verify row's accepted tokens)."""
        tokens = tokens.reshape(slots.shape[0], -1)
        ones = torch.ones_like(tokens, dtype=torch.int32) if valid is None else valid.to(torch.int32)
        flat = slots[:, None].expand_as(tokens) * self.vocab + tokens
        self.out_counts.view(-1).index_add_(0, flat.reshape(-1), ones.reshape(-1))
