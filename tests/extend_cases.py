"""EXTEND steps for the tests of engine/extend.py (CPU) and of its Triton kernels (tests/gpu): prefill chunks
(fresh and continuing), a decoding row riding along, and runs of new KV locations that reach past the fed tokens
or that a row does not need (reserved ahead)."""

import torch

from hylo.core import ForwardMode, Req
from hylo.sampling_params import SamplingParams
from hylo.engine.plan import ScheduledBatch


def extend_case(seed: int = 0, big: bool = False, runs: bool = True):
    """A ScheduledBatch and the request tables (req_to_token [S+1, C], last_token [S+1]) before the step; without
    ``runs``, every location was reserved before the step (no new run)."""
    g = torch.Generator().manual_seed(seed)
    ctx = 6000 if big else 64
    r2t = torch.randint(1, 10_000, (9, ctx), generator=g)
    last = torch.randint(0, 500, (9,), generator=g)
    # (req slot, state slot, prompt length, prefix, fed, from_device, new KV run (first, count) or None)
    rows = [(3, 2, 40, 0, 40, False, (0, 42)),     # a fresh prompt, two positions reserved past it
            (5, -1, 30, 12, 18, False, (12, 18)),  # the last chunk of a prompt, no state slot
            (1, 0, 9, 9, 1, True, (9, 1)),         # a decoding row: its newest token is on the device
            (7, 4, 20, 16, 1, True, None)]         # decoding, its location reserved ahead (no new run)
    if big:
        rows[0] = (3, 2, 5000, 0, 5000, False, (0, 5000))
        rows.append((8, 5, 2000, 1000, 700, False, (1000, 700)))
    reqs, plan = [], ScheduledBatch([], [], [], [], ForwardMode.EXTEND)
    for i, (slot, state, plen, prefix, n, dev, run) in enumerate(rows):
        prompt = torch.randint(0, 500, (plen,), generator=g).tolist()
        r = Req(f"r{i}", prompt, SamplingParams(temperature=0.5 * i, top_p=0.9, top_k=i), seed=100 + i)
        r.req_slot, r.state_slot = slot, state
        reqs.append(r)
        plan.reqs.append(r)
        plan.extend_lens.append(n)
        plan.prefix_lens.append(prefix)
        plan.sample.append(dev or prefix + n == plen)
        plan.from_device.append(dev)
        plan.generated.append(dev)
        if run is not None and runs:
            plan.kv_starts.append((slot, run[0]))
            plan.kv_locs.append(torch.randint(20_000, 30_000, (run[1],), generator=g, dtype=torch.int32))
    return plan, r2t, last
