"""Wires speculative decoding into an engine: loads the drafter's model and wraps the plain worker."""

from __future__ import annotations

import torch

from ..config import EngineConfig
from ..engine.worker import ModelWorker
from ..models.mtp import MTPHead
from ..models.registry import build_mtp
from .mtp import MTPDrafter
from .ngram import NgramDrafter
from .worker import SpecWorker


class SpecSetup:
    def __init__(self, method: str):
        if method not in ("mtp", "ngram"):
            raise ValueError(f"unknown speculative method {method!r}: use 'mtp' or 'ngram'")
        self.method = method
        self.mtp: MTPHead | None = None

    def prepare(self, loaded, dtype: torch.dtype, device: torch.device) -> int:
        """Load the MTP head (a clear error if the checkpoint has none). Returns the extra KV layers it needs."""
        if self.method != "mtp":
            return 0
        self.mtp = build_mtp(loaded.shard_config, loaded.model, dtype, device)
        self.mtp.load(loaded.reader)
        self.mtp.eval()
        return self.mtp.num_kv_layers

    def wrap(self, worker: ModelWorker, ec: EngineConfig) -> SpecWorker:
        k = ec.num_speculative_tokens
        if self.method == "mtp":
            drafter = MTPDrafter(self.mtp, k, ec.max_num_seqs, worker.device)
        else:
            drafter = NgramDrafter(k, ec.max_num_seqs, worker.caches.req_slots.max_context, worker.device)
        return SpecWorker(worker, drafter, k, ec.simulate_accept_length, ec.seed,
                          plain_steps=ec.spec_policy == "adaptive")
