"""When speculation pays: the host-side policy that picks, step by step, whether the decoding rows verify k drafts
or decode one token plainly, so that speculation never loses to plain decoding.

A verify step costs more than a plain one (k + 1 tokens per row through the target, then the drafts); it pays when
the rows accept enough drafts. The policy compares the two per generated token:

- **yield**: a verify row emits ``1 + a`` tokens, ``a`` its expected accepted drafts: a running estimate per request
  (``Req.spec.accept_estimate``, exponential decay ``ALPHA``), updated from the accepted counts the host reads back
  anyway, one step late through the overlapped result copy: choosing needs no device read at all. A request that
  has not verified yet takes the engine's running mean over all verify rows (``PRIOR_ALPHA``; k / 2 at first), so
  a workload whose drafts fail does not make every new request pay a few verifies to find out;
- **cost**: the device time of each kind of step at each batch size, as this engine measured it (``observe_step``:
  CUDA events around the launch, read when the step's results are), before any measurement the ratio ``PRIOR_RATIO``.

A step verifies when the batch's mean yield beats the cost ratio by ``MARGIN``. Otherwise it decodes plainly, and
the rows are probed again now and then: a verify after ``interval`` plain steps (16 at first), the interval doubling
after every probe that did not bring speculation back (up to ``MAX_INTERVAL``) and reset when speculation pays
again, so a request whose text turns predictable returns to speculation while one that never accepts costs at most a
probe in ``MAX_INTERVAL`` steps.

Verification needs drafts made by the step before it, so the policy decides one step ahead: a plain step drafts at
its end (``draft_after``) when the next step is to verify, and a row whose last step drafted nothing decodes plainly
once more (``Req.has_drafts``). Rows in one step share its width (the captured graphs are plain decode and the
k + 1 verify); every row of a verify step keeps its k drafts, since a shorter draft costs the step nothing less.
``fixed`` (``EngineConfig.spec_policy``) verifies at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest verify in a request's acceptance estimate
PRIOR_ALPHA = 0.05  # weight of each verify row in the engine-wide estimate new requests start from
MARGIN = 0.03  # a verify step must beat plain decoding per token by this fraction
PRIOR_RATIO = 2.0  # verify-step cost over plain-step cost before either is measured at any batch size
COST_DECAY = 0.2  # weight of the newest measurement in a step-cost estimate
BASE_INTERVAL, MAX_INTERVAL = 16, 256  # plain steps between probes


@dataclass
class StepChoice:
    verify: bool  # this step verifies the rows' drafts (else it decodes one token per row)
    draft_after: bool  # the step ends by drafting for the next one (a verify step always does)
    probe: bool = False  # a verify the estimates alone would not have chosen


class DraftPolicy:
    def __init__(self, k: int, adaptive: bool = True):
        self.k = k
        self.adaptive = adaptive
        # a new request is assumed to accept half its drafts until its own verifies say otherwise
        self.prior_accept = k / 2
        self.costs: dict[tuple[bool, int], float] = {}  # (verify, batch size) -> device ms per step
        self.interval = BASE_INTERVAL
        self.plain_run = 0  # plain steps since the last verify

    # ---- estimates ------------------------------------------------------------------------------------------------
    def accept_estimate(self, req) -> float:
        est = req.spec.accept_estimate
        return self.prior_accept if est is None else est

    def observe_row(self, req, accepted: int) -> None:
        """A verify row's accepted draft count, as the host reads it."""
        self.prior_accept = (1 - PRIOR_ALPHA) * self.prior_accept + PRIOR_ALPHA * accepted
        est = req.spec.accept_estimate
        req.spec.accept_estimate = accepted if est is None else (1 - ALPHA) * est + ALPHA * accepted

    def observe_verify(self, accepted: list[int]) -> None:
        """A whole verify step's accepted counts (after ``observe_row`` of each): one whose rows emitted enough to
        beat plain decoding brings the probes back to their base interval, so a request whose text became
        predictable returns to speculation within a probe or two."""
        if accepted and sum(1 + a for a in accepted) / len(accepted) > self.cost_ratio(len(accepted)) * (1 + MARGIN):
            self.interval = BASE_INTERVAL

    def observe_step(self, verify: bool, batch_size: int, ms: float) -> None:
        """A decode or verify step's measured device time."""
        key = (verify, batch_size)
        old = self.costs.get(key)
        self.costs[key] = ms if old is None else (1 - COST_DECAY) * old + COST_DECAY * ms

    def cost_ratio(self, batch_size: int) -> float:
        """Verify-step cost over plain-step cost at this batch size: measured at it, else at the nearest batch size
        where both were measured, else the prior."""
        both = [bs for (v, bs) in self.costs if v and (False, bs) in self.costs]
        if not both:
            return PRIOR_RATIO
        bs = min(both, key=lambda b: (abs(b - batch_size), b))
        return self.costs[(True, bs)] / max(self.costs[(False, bs)], 1e-9)

    def pays(self, reqs) -> bool:
        """Whether verifying these rows yields more tokens per unit of device time than decoding them plainly."""
        gain = sum(1 + self.accept_estimate(r) for r in reqs) / len(reqs)
        return gain > self.cost_ratio(len(reqs)) * (1 + MARGIN)

    # ---- the choice -----------------------------------------------------------------------------------------------
    def choose(self, reqs) -> StepChoice:
        """The kind of the next step of these decoding rows (called once per step, when it is scheduled)."""
        if not self.adaptive:
            return StepChoice(True, True)
        ready = all(r.has_drafts for r in reqs)
        if self.pays(reqs):
            self.interval = BASE_INTERVAL
            if ready:
                self.plain_run = 0
                return StepChoice(True, True)
            self.plain_run += 1
            return StepChoice(False, True)
        due = self.plain_run >= self.interval
        if due and ready:  # a probe: the estimates learn from it; the next probe waits longer unless it pays
            self.plain_run = 0
            self.interval = min(2 * self.interval, MAX_INTERVAL)
            return StepChoice(True, True, probe=True)
        self.plain_run += 1
        return StepChoice(False, due or self.plain_run >= self.interval)  # drafts for a probe next
