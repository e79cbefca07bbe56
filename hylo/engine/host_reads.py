"""The one gate for device-to-host reads in the engine loop (DESIGN section 7).

Every read of a step's results goes through ``HostReads``, so the number of blocking reads per step is a counted
fact, not a hope. A step's results leave the device by a non-blocking copy into pinned host memory followed by an
event (``start``); the host waits on that event later (``PendingRead.wait``).

A wait is *blocking* when nothing was launched after the read started: the device then runs dry while the host
waits (the plain loop: launch, then wait for the same step). In the overlap loop the host launches step N+1 before
it waits for step N, so the wait overlaps with queued work and counts as *overlapped*. ``read`` is an immediate
read of a device tensor and always blocking; the engine loop does not use it.
"""

from __future__ import annotations

import time

import torch


class PendingRead:
    """A device tensor on its way to the host."""

    def __init__(self, gate: "HostReads", host: torch.Tensor, event, launch_seq: int):
        self._gate, self._host, self._event, self._seq = gate, host, event, launch_seq
        self._value: list | None = None

    def wait(self) -> list:
        if self._value is None:
            gate = self._gate
            if gate.launches > self._seq:
                gate.overlapped += 1
            else:
                gate.blocking += 1
            if self._event is not None:
                self._event.synchronize()
            self._value = self._host.tolist()
        return self._value


class HostReads:
    def __init__(self):
        self.blocking = 0  # waits with no later work queued on the device (the device idles meanwhile)
        self.overlapped = 0  # waits behind later queued work
        self.launches = 0

    def note_launch(self) -> None:
        """A step was launched: reads started before this point now wait behind it."""
        self.launches += 1

    def start(self, t: torch.Tensor) -> PendingRead:
        """Start copying ``t`` to the host without waiting for it."""
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # CPU tensors are ready as soon as the call that made them returned
            host, event = t.clone(), None
        return PendingRead(self, host, event, self.launches)

    def read(self, t: torch.Tensor) -> list:
        """An immediate (blocking) read."""
        self.blocking += 1
        return t.tolist()


class StepTimer:
    """The device time of one launched step, read without a sync of its own: CUDA events recorded before and after
    its launches, whose interval the host takes once it has waited for the step's results anyway (``ms`` after that
    read's ``wait``). Off CUDA, the host time of the launch (the CPU path computes as it launches)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> "StepTimer":
        if self._cuda:
            self._end.record()
        else:
            self._ms = (time.perf_counter() - self._t0) * 1e3
        return self

    def ms(self) -> float:
        """Call after the step's results were read (its end event has then completed)."""
        return self._start.elapsed_time(self._end) if self._cuda else self._ms
