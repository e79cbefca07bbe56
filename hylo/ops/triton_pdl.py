"""Programmatic dependent launch (Hopper and later) for the decode-path kernels; see ``triton_utils.pdl_launch``."""

import triton
import triton.language as tl

from .triton_utils import env_kinds

# HYLO_EARLY_LOADS: decode-path kernels load what does not depend on the kernel before them before their
# ``pdl_enter``, while that kernel still runs, so that only the loads of its outputs stay on the critical path:
# "gdn" the GDN step's recurrent state, "conv" the decode conv's window and weights. A comma list of them, 1 for
# both, 0 for neither. Safe because a kernel launched with PDL starts only once every program of the kernel before
# it has passed its own wait, i.e. once the kernel two back has finished: only the previous kernel's writes may not
# be visible yet, and neither state is written by the kernel before its reader. Default both: in two rounds on the
# H100 (session 19) they took 0.015 and 0.021 ms off the batch-1 step's graph (1.852 -> 1.837, 1.857 -> 1.836 ms),
# and in session 20 0.012 at batch 1 and 0.034 at batch 8 (ab-decode-20261205-154512). The GEMVs' first block of
# weights early was measured too (session 19: 0.075 ms slower at batch 1; for the router alone, no change) and
# taken out again.
EARLY_KINDS = ("gdn", "conv")
EARLY_LOADS = env_kinds("HYLO_EARLY_LOADS", EARLY_KINDS, "gdn,conv")


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First thing in a kernel that takes ``PDL`` (after only what ``EARLY_LOADS`` allows): with it set (the kernel
    was launched with ``launch_pdl``), wait until the previous kernel in the stream has finished and its writes are
    visible, and allow the next kernel to be scheduled onto free SMs while this one runs (it will wait here in
    turn). A no-op when PDL is off."""
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
