"""Programmatic dependent launch (Hopper and later) for the decode-path kernels; see ``triton_utils.pdl_launch``."""

import os

import triton
import triton.language as tl

# HYLO_EARLY_LOADS=1: the latency-bound recurrent kernels of a decode step (the GDN step, the conv step) load what
# does not depend on the kernel before them (the recurrent state, the conv window and weights) before their
# ``pdl_enter``, while that kernel still runs, so that only the loads of its outputs stay on the critical path.
# Safe because a kernel launched with PDL starts only once every program of the kernel before it has passed its
# own wait, i.e. once the kernel two back has finished: only the previous kernel's writes are not yet visible, and
# neither kernel reads anything the previous one writes besides its input rows. Off by default until measured.
EARLY_LOADS = os.environ.get("HYLO_EARLY_LOADS", "0") == "1"


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First thing in a kernel that takes ``PDL``: with it set (the kernel was launched with ``launch_pdl``), wait
    until the previous kernel in the stream has finished and its writes are visible, then allow the next kernel to
    be scheduled onto free SMs while this one runs (it will wait here in turn). A no-op when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptrs):
    """Ask for the cache lines at ``ptrs`` (one address per line is enough) to be brought into L2, writing no
    register. For a kernel launched early by PDL: it prefetches the weights it is about to stream, which do not
    depend on the previous kernel, before its ``pdl_enter``, so that the memory system works while the previous
    kernel's latency-bound tail (a norm, a recurrent step) runs."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)
