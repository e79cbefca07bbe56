"""Request slots: which KV locations and which state slot belong to each running request."""

from __future__ import annotations

import sys

import torch

from ..core import to_device
from .penalty_tables import PenaltyTables

SAMPLING_INTS = 5  # the columns of ReqSlots.sampling_i


class ReqSlots:
    """``req_to_token[slot, pos]`` is the KV pool location of position ``pos`` of the request in ``slot``.

    ``last_token[slot]`` and ``seq_len[slot]`` are the device-resident request tables of the overlap loop: the newest
    sampled token (not yet fed) and the tokens committed to the caches. Every step writes them on the device, and
    the next step gathers a decoding row's inputs from them, so launching a step never waits for the previous
    step's results.

    NOTE: slot 0 is reserved as the padding row. Padded batch rows point at it, its ``req_to_token`` row is all
    location 0 (the KV pool's dummy location) and a padded row's state slot is -1, so a padded row reads nothing
    real and its writes land on dummies.
    """

    def __init__(self, max_num_seqs: int, max_context: int, device: torch.device):
        self.max_num_seqs = max_num_seqs
        self.max_context = max_context
        self.req_to_token = torch.zeros(max_num_seqs + 1, max_context, dtype=torch.int64, device=device)
        self.last_token = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
        self.seq_len = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=device)
        # each request's sampling parameters, written once when its prefill starts: (temperature, top_p) and
        # (top_k, seed, prompt length, max_tokens, 1 if the model's end-of-sequence ids stop it); a step gathers its
        # rows' instead of copying them from the host
        self.sampling_f = torch.ones(max_num_seqs + 1, 2, dtype=torch.float32, device=device)
        self.sampling_i = torch.zeros(max_num_seqs + 1, SAMPLING_INTS, dtype=torch.int64, device=device)
        self._free = list(range(max_num_seqs, 0, -1))  # pop() hands out 1, 2, ...
        self.penalties: PenaltyTables | None = None  # allocated when a request first asks for penalties or bias
        self.constraints = None  # constrain.tables.ConstraintTables, made when a request first has a constraint

    def ensure_constraints(self, vocab: int, eos_ids):
        if self.constraints is None:
            from ..constrain.tables import ConstraintTables

            self.constraints = ConstraintTables(self.max_num_seqs, vocab, self.req_to_token.device, eos_ids)
        return self.constraints

    def ensure_penalties(self, vocab: int) -> PenaltyTables:
        if self.penalties is None:
            self.penalties = PenaltyTables(self.max_num_seqs, vocab, self.req_to_token.device)
            print(f"[hylo] penalty tables allocated for {self.max_num_seqs} request slots "
                  f"({self.penalties.bytes / 2 ** 20:.1f} MiB)", file=sys.stderr)
        return self.penalties

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.max_num_seqs - len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 < slot <= self.max_num_seqs and slot not in self._free, f"bad request slot free: {slot}"
        self._free.append(slot)
        if self.constraints is not None:  # its automaton leaves the table at the next rebuild
            self.constraints.release(slot)

    def write_locations(self, triples: torch.Tensor | None) -> None:
        """Record the KV locations of newly allocated positions, given as host int64 (request slot, position,
        location) triples [3, W] (one copy to the device, one scatter)."""
        if triples is None or not triples.shape[1]:
            return
        self.scatter_locations(*to_device(triples, self.req_to_token.device))

    def scatter_locations(self, rows: torch.Tensor, cols: torch.Tensor, locs: torch.Tensor) -> None:
        """``req_to_token[rows[i], cols[i]] = locs[i]``, on the device (a staged graph's prologue runs this)."""
        self.req_to_token[rows, cols] = locs

    def write_sampling(self, slots: list[int], floats: list[tuple[float, float]],
                       ints: list[tuple[int, int, int]]) -> None:
        """Store requests' sampling parameters in their slots' rows (at the start of their prefill)."""
        if not slots:
            return
        dev = self.sampling_f.device
        idx = to_device(torch.tensor(slots, dtype=torch.int64), dev)
        self.sampling_f[idx] = to_device(torch.tensor(floats, dtype=torch.float32), dev)
        self.sampling_i[idx] = to_device(torch.tensor(ints, dtype=torch.int64), dev)

    def write_sampling_rows(self, slots: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> None:
        """:meth:`write_sampling` from tensors already on the device: slots [S], floats [S, 2], ints [S, 5]."""
        self.sampling_f[slots] = floats
        self.sampling_i[slots] = ints

    def record(self, slots: torch.Tensor, seq_lens: torch.Tensor, sampled_slots: torch.Tensor | None = None,
               tokens: torch.Tensor | None = None) -> None:
        """After a step, on the device: the committed lengths of its rows and the new tokens of its sampling rows."""
        self.seq_len[slots] = seq_lens
        if tokens is not None and tokens.numel():
            self.last_token[sampled_slots] = tokens
