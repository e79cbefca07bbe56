"""Programmatic dependent launch (Hopper and later) for the decode-path kernels; see ``triton_utils.pdl_launch``."""

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First thing in a kernel that takes ``PDL``: with it set (the kernel was launched with ``launch_pdl``), wait
    until the previous kernel in the stream has finished and its writes are visible, then allow the next kernel to
    be scheduled onto free SMs while this one runs (it will wait here in turn). A no-op when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
