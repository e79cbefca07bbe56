"""MTP drafter: the checkpoint's multi-token-prediction head proposes k tokens by chaining itself.

After the target prefills a chunk or verifies drafts, one DRAFT_EXTEND pass feeds the MTP head every new position's
pair (target hidden at position j, token at j + 1): this brings the head's KV up to date with the committed tokens,
and its output at the newest position gives draft 1. Drafts 2..k come from DRAFT_DECODE steps that feed the head its
own previous output with the previous draft. After a verify the extend pass has a fixed shape (k + 1 rows per
request, the accepted count picks the output row on the device); its entries past the accepted tokens are garbage
that the draft steps overwrite before anything reads them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core import ForwardBatch, ForwardMode, SamplingBatch
from ..models.mtp import MTPHead
from ..ops.sampling import draw, greedy_tokens, sampling_probs
from .drafter import Drafter


class MTPDrafter(Drafter):
    fused_greedy = True

    def __init__(self, mtp: MTPHead, k: int, max_num_seqs: int, device: torch.device):
        self.mtp = mtp
        self.k = k
        self.drafts = torch.zeros(max_num_seqs + 1, k, dtype=torch.int64, device=device)
        self._draft_states = None  # constrained rows: the automaton states after the drafts so far (``_pick``)

    def forward(self, worker, batch: ForwardBatch, hidden: torch.Tensor, graph: str | None = None):
        """The head over ``batch`` (its input_ids are the tokens) and the given hidden states: (MTP hidden, logits),
        through the captured graph ``graph`` when there is one for this batch size."""
        graphs = worker.graphs
        if graph is not None and graphs is not None and graphs.can_run(graph, batch.batch_size):
            out = graphs.run(graph, batch, {"hidden": hidden})
            return out["hidden"], out["logits"]
        out = self.graph_fn(worker.backend)(batch, {"hidden": hidden})
        return out["hidden"], out["logits"]

    def _direct(self, worker, batch: ForwardBatch, hidden: torch.Tensor, graph: str | None = None):
        """``forward`` without a graph of its own: inside a captured step, which replays the head with it."""
        return self.forward(worker, batch, hidden)

    def graph_fn(self, backend):
        """The head and its logits: what the captured DRAFT_EXTEND / DRAFT_DECODE graphs run (and the eager path)."""
        def fn(batch, extras):
            m = self.mtp(batch.input_ids, extras["hidden"], batch, backend)
            return {"hidden": m, "logits": self.mtp.compute_logits(m)}
        return fn

    def _pick(self, logits: torch.Tensor, req_slots: torch.Tensor, sb: SamplingBatch | None,
              base_steps: torch.Tensor | None, i: int, worker=None) -> torch.Tensor:
        """Draft i from MTP logits: argmax for greedy rows (every row when ``sb`` is None), a draw from q for the
        others. Constrained rows draft under their constraint: draft i is masked by the state after drafts
        0..i-1 (from the slot's state, which the target's step moved on already), so that their drafts are ones the
        verify's masked target can accept (a draft never changes what is emitted, only how much is accepted:
        ``verify.coupled_accept``)."""
        if sb is not None and sb.constrained:
            tables = worker.caches.req_slots.constraints
            states = tables.state[req_slots] if i == 0 else self._draft_states
            logits = tables.mask_logits(logits, states)
        token = greedy_tokens(logits)
        if sb is not None and not sb.all_greedy:
            q = sampling_probs(logits, sb)
            # the noise the target's draw at this output index will use (verify.coupled_accept): where q is
            # close to p the draft is likely the very token the target draws
            token = torch.where(sb.temperatures > 0, draw(q, sb.seeds, base_steps + i), token)
        self.drafts[req_slots, i] = token
        if sb is not None and sb.constrained:
            self._draft_states = tables.next_states(states, token)
        return token

    def _chain(self, run_head, worker, hidden, token, positions0, req_slots, state_slots, max_seq_len, sb,
               base_steps):
        """Drafts 2..k: each step feeds (previous MTP output, previous draft) at the next position. ``run_head``:
        ``forward``, or inside a captured graph the head itself."""
        if self.k < 2:
            return
        bs = req_slots.shape[0]
        # every step's positions, lengths and KV locations at once: no launches between the steps
        pos = positions0[:, None] + torch.arange(self.k - 1, device=req_slots.device)[None, :]  # [B, k-1]
        locs = worker.caches.req_slots.req_to_token[req_slots[:, None], pos]
        qsl = torch.arange(bs + 1, device=req_slots.device)
        width = worker.caches.req_slots.max_context
        for i in range(1, self.k):
            p = pos[:, i - 1]
            batch = ForwardBatch(
                mode=ForwardMode.DRAFT_DECODE, input_ids=token, positions=p, req_slots=req_slots,
                state_slots=state_slots, seq_lens=p + 1, query_start_loc=qsl, out_cache_loc=locs[:, i - 1],
                max_seq_len=min(max_seq_len + i, width))
            hidden, logits = run_head(worker, batch, hidden, "draft_decode")
            token = self._pick(logits, req_slots, sb, base_steps, i, worker)

    def after_prefill(self, worker, batch: ForwardBatch, hidden: torch.Tensor, next_ids: torch.Tensor,
                      tok_idx: torch.Tensor, row_idx: torch.Tensor, sb: SamplingBatch, max_seq_len: int) -> None:
        """batch: the target's EXTEND batch; next_ids: [T] the token after each fed token (the sampled one at the
        end of a finished prompt); tok_idx / row_idx: token index and batch row of each sampling row's last token;
        max_seq_len: host bound of those rows' lengths."""
        out = self.mtp(next_ids, hidden, replace(batch, mode=ForwardMode.DRAFT_EXTEND, input_ids=next_ids),
                       worker.backend)
        if tok_idx.numel() == 0:
            return
        req_slots, state_slots = batch.req_slots[row_idx], batch.state_slots[row_idx]
        last = out[tok_idx]
        base = sb.steps + 1
        first = self._pick(self.mtp.compute_logits(last), req_slots, sb, base, 0, worker)
        self._chain(self.forward, worker, last, first, batch.positions[tok_idx] + 1, req_slots, state_slots,
                    max_seq_len, sb, base)

    def after_decode(self, worker, batch: ForwardBatch, hidden: torch.Tensor, tokens: torch.Tensor,
                     sb: SamplingBatch | None, draft: bool, fused: bool = False) -> None:
        """After a plain decode step (the target's DECODE batch, one token per row: its hidden states and the
        tokens it chose): the head's pair at each row's position (its hidden, the new token) keeps the head's KV
        complete, so that later drafts attend to every position. Without ``draft`` only that KV is written (no
        logits, no chain: about a projection's worth of work); with it, drafts 1..k follow as after a prefill.
        ``fused``: inside a captured step (the head runs directly, no graph of its own)."""
        pos = batch.positions
        mtp_batch = ForwardBatch(
            mode=ForwardMode.DRAFT_DECODE, input_ids=tokens, positions=pos, req_slots=batch.req_slots,
            state_slots=batch.state_slots, seq_lens=pos + 1, query_start_loc=batch.query_start_loc,
            out_cache_loc=batch.out_cache_loc, max_seq_len=batch.max_seq_len)
        if not draft:
            self.mtp.write_kv(tokens, hidden, mtp_batch, worker.backend)
            return
        run_head = self._direct if fused else self.forward
        out, logits = run_head(worker, mtp_batch, hidden, "draft_decode")
        base = None if sb is None else sb.steps + 1
        first = self._pick(logits, batch.req_slots, sb, base, 0, worker)
        self._chain(run_head, worker, out, first, pos + 1, batch.req_slots, batch.state_slots, batch.max_seq_len,
                    sb, base)

    def after_verify(self, worker, batch: ForwardBatch, hidden: torch.Tensor, emitted: torch.Tensor,
                     accepted: torch.Tensor, sb: SamplingBatch) -> None:
        """batch: the TARGET_VERIFY batch ([B * (k+1)] tokens); emitted/accepted: the acceptance result. Each pass
        replays its own graph, with the picks and the next pass's inputs launched in between (a step whose rows
        are all greedy runs ``draft_greedy`` inside the speculative worker's fused step instead)."""
        mtp_batch = replace(batch, mode=ForwardMode.DRAFT_EXTEND, input_ids=emitted.reshape(-1))
        self._draft_phase(self.forward, worker, mtp_batch, hidden, accepted, sb)

    def draft_greedy(self, worker, mtp_batch: ForwardBatch, hidden: torch.Tensor, accepted: torch.Tensor) -> None:
        """The draft phase after a verify of greedy rows with the head run directly, no graph of its own: what the
        speculative worker's fused step runs, captured as one graph or eagerly. ``mtp_batch``: the DRAFT_EXTEND
        batch (k + 1 tokens per row, the emitted tokens at the verified positions)."""
        self._draft_phase(self._direct, worker, mtp_batch, hidden, accepted, None)

    def _draft_phase(self, run_head, worker, mtp_batch: ForwardBatch, hidden: torch.Tensor, accepted: torch.Tensor,
                     sb: SamplingBatch | None) -> None:
        """The extend pass over the verified positions, then drafts 1..k from the newest accepted one. ``sb`` None:
        every row greedy."""
        k1 = self.k + 1
        out, logits = run_head(worker, mtp_batch, hidden, "draft_extend")
        bs = accepted.shape[0]
        rows = torch.arange(bs, device=out.device)
        # the pair (target hidden, token) at the newest committed position gives draft 1
        last = out.view(bs, k1, -1)[rows, accepted]
        base = None if sb is None else sb.steps + accepted + 1
        first = self._pick(logits.view(bs, k1, -1)[rows, accepted], mtp_batch.req_slots, sb, base, 0, worker)
        positions0 = mtp_batch.seq_lens - k1 + accepted + 1
        self._chain(run_head, worker, last, first, positions0, mtp_batch.req_slots, mtp_batch.state_slots,
                    mtp_batch.max_seq_len, sb, base)
