"""Whether the Triton kernels can run, and the one switch that picks them.

Triton is an optional dependency (the ``gpu`` extra): on a machine without it, or for CPU tensors, every op runs its
torch reference. ``HYLO_TRITON_INTERPRET=1`` (with ``TRITON_INTERPRET=1``) lets the kernel tests run the Triton
kernels on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # pragma: no cover - depends on the environment
    import triton  # noqa: F401  (imported to learn whether it is usable)

    HAS_TRITON = True
except Exception:  # ImportError, or a Triton that cannot find a driver
    HAS_TRITON = False

INTERPRET = os.environ.get("HYLO_TRITON_INTERPRET") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t``'s op should run its Triton kernel."""
    if not HAS_TRITON or os.environ.get("HYLO_DISABLE_TRITON") == "1":
        return False
    return t.is_cuda or INTERPRET


def env_cfg(var: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """A kernel's launch configuration from the environment variable ``var`` ("32,4"), else ``default``: the
    settings through which a benchmark right after a sweep takes the sweep's winners (``tune_kernels --env``)."""
    text = os.environ.get(var)
    if text is None:
        return default
    try:
        cfg = tuple(int(v) for v in text.split(","))
    except ValueError:
        cfg = ()
    if len(cfg) != len(default) or min(cfg) < 1:
        raise ValueError(f"{var}={text!r}: expected {len(default)} positive integers separated by commas")
    return cfg


def env_flag(var: str, default: bool) -> bool:
    """An on/off setting from the environment variable ``var`` ("1" or "0"), else ``default``; anything else is
    refused with the variable named (a "yes" must not quietly mean off)."""
    text = os.environ.get(var)
    if text is None:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{var}={text!r}: expected 1 (on) or 0 (off)")
    return text == "1"


def env_int(var: str, default: int, minimum: int = 1) -> int:
    """An integer setting from the environment variable ``var``, else ``default``; refused, with the variable
    named, unless it is an integer of at least ``minimum``."""
    text = os.environ.get(var)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{var}={text!r}: expected an integer of at least {minimum}")
    return value


def env_kinds(var: str, kinds: tuple[str, ...], default: str) -> frozenset:
    """A set of named kinds from the environment variable ``var`` (else ``default``): a comma list of ``kinds``,
    1 for all of them, 0 or nothing for none; an unknown name is refused with the variable named."""
    text = os.environ.get(var, default)
    if text in ("", "0"):
        return frozenset()
    chosen = frozenset(kinds) if text == "1" else frozenset(k.strip() for k in text.split(","))
    unknown = chosen - set(kinds)
    if unknown:
        raise ValueError(f"{var}={text!r}: unknown {sorted(unknown)} (known: {', '.join(kinds)}, or 1 or 0)")
    return chosen


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (132 on an H200; CPU tensors, in Triton's interpreter, count as
    an H200)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_tile(n: int) -> int:
    """A tile width for a dimension that enters ``tl.dot``: the next power of two, at least 16 (the compiler
    refuses smaller dot operands; Triton's interpreter does not, so only a GPU run catches it)."""
    return max(16, next_pow2(n))


@functools.lru_cache(maxsize=None)
def _pdl_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


# programmatic dependent launch of the decode-path kernels, on by default on Hopper and later (bench-6b batch 1:
# 1.73 against 1.86 ms per step, run -060034); HYLO_PDL=0 at start-up turns it off, set_pdl() switches it (the
# benchmark's comparison). Read once, not per launch: launches are on the host's hot path.
_PDL = env_flag("HYLO_PDL", True)
# with PDL, the weight-streaming kernels may prefetch their weights into L2 before waiting on the previous kernel
# (``triton_pdl.l2_prefetch``). Off unless HYLO_PDL_PREFETCH=1: measured slower (batch 1 1.87 against 1.73 ms,
# batch 8 3.98 against 3.74): the prefetches compete with the running kernel's own loads. A selective prefetch
# (only the projections behind a latency-bound kernel, 16 MiB in all) was no faster either (session 13,
# ab-decode-20261204-032522: batch 1 1.624 against 1.612 ms of graph time) and was taken out again.
_PREFETCH = env_flag("HYLO_PDL_PREFETCH", False)


def set_pdl(enabled: bool, prefetch: bool | None = None) -> tuple[bool, bool]:
    """Switch programmatic dependent launch (and with it the weight prefetch, unless ``prefetch`` says otherwise)
    for kernels launched (or graphs captured) from now on; returns the previous (enabled, prefetch), which
    ``set_pdl(*previous)`` restores."""
    global _PDL, _PREFETCH
    previous = (_PDL, _PREFETCH)
    _PDL = enabled
    if prefetch is not None:
        _PREFETCH = prefetch
    return previous


def pdl_settings() -> tuple[bool, bool]:
    """(PDL on, weight prefetch on), as ``set_pdl`` takes them."""
    return _PDL, _PREFETCH


def pdl_prefetch() -> bool:
    """Whether kernels launched with PDL prefetch their weights before they wait."""
    return _PDL and _PREFETCH


def prefetch_args(row_elems: int, w: torch.Tensor) -> dict:
    """The L2-prefetch launch arguments of a kernel that streams rows of ``row_elems`` elements of ``w`` (see
    ``triton_pdl.l2_prefetch``): ``PF_LINES`` 128-byte lines per row, ``PF_STRIDE`` elements apart; no lines
    unless the prefetch is on."""
    line = 128 // w.element_size()
    return dict(PF_LINES=next_pow2((row_elems + line - 1) // line) if pdl_prefetch() else 0, PF_STRIDE=line)


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch options of the decode-path kernels for programmatic dependent launch (Hopper and later): such a
    kernel may be scheduled while the previous kernel in the stream drains, and waits for it
    (``griddepcontrol.wait``, in ``triton_pdl.pdl_enter``) before it writes anything or reads what that kernel
    wrote (``triton_pdl.EARLY_LOADS``: what it may read before).
    Empty (a plain launch) when switched off or elsewhere."""
    if _PDL and t.is_cuda and _pdl_supported():
        return {"PDL": True, "launch_pdl": True}
    return {}
