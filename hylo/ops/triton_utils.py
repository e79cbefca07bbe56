"""Whether the Triton kernels can run, and the one switch that picks them.

Triton is an optional dependency (the ``gpu`` extra): on a machine without it, or for CPU tensors, every op runs its
torch reference. ``HYLO_TRITON_INTERPRET=1`` (with ``TRITON_INTERPRET=1``) lets the kernel tests run the Triton
kernels on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

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


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
