"""The prefill's chunked gated delta rule through flash-linear-attention (the ``fla-core`` package, optional).

fla's public ``chunk_gated_delta_rule`` is built for training: a dynamo guard, a backend dispatch, an autograd
Function and a contiguity guard wrap every call, and it takes the decay ``g`` ready-made, which the caller computes
in about ten small torch launches per layer. Here, when fla's forward pass can be reached under it (fla-core
0.6.0's ``chunk_gated_delta_rule_fwd``), it is called directly with the gate computed in fla's chunk-cumsum kernel
(``-exp(A_log) * softplus(a + dt_bias)``, the formula of ``ops.gdn.gdn_gating``). An 8192-token prefill of bench-6b
launches about 1650 kernels, and its host time decides whether the GPU waits, so launches matter here. Other fla
versions go through the public function, with the gate from ``gdn_gating``.
"""

from __future__ import annotations

import inspect

from .gdn import gdn_gating

_DIRECT_ARGS = {"cu_seqlens", "chunk_indices", "use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"}


class FlaPrefill:
    def __init__(self, public, forward=None, l2norm=None):
        self.public, self.forward, self.l2norm = public, forward, l2norm

    @property
    def direct(self) -> bool:
        return self.forward is not None

    def __call__(self, q, k, v, a, b, A_log, dt_bias, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                 chunk_size: int, qk_normed: bool = False):
        """q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (contiguous); a, b: [T, Hv] raw gate inputs; initial_state:
        [N, Hv, Dk, Dv] float32. q and k are L2-normalised here unless ``qk_normed``. Returns (o [T, Hv, Dv] in
        v's dtype, final states [N, Hv, Dk, Dv] float32)."""
        scale = q.shape[-1] ** -0.5
        if self.direct:
            if not qk_normed:
                q, k = self.l2norm(q)[0], self.l2norm(k)[0]
            a, beta = _gates(a, b)
            _, o, _, final, _, _ = self.forward(
                q[None], k[None], v[None], a[None], beta[None], scale, initial_state,
                True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, use_gate_in_kernel=True, A_log=A_log,
                dt_bias=dt_bias, chunk_size=chunk_size)
            return o[0], final
        g, beta = gdn_gating(A_log, a, dt_bias, b)
        o, final = self.public(q[None], k[None], v[None], g=g[None], beta=beta[None], scale=scale,
                               initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens,
                               cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, chunk_size=chunk_size,
                               use_qk_l2norm_in_kernel=not qk_normed)
        return o[0], final


def _gates(a, b):
    """The gate inputs as fla's forward takes them: a contiguous, beta = sigmoid(b) in float32."""
    if a.is_cuda:
        from .gdn_triton import prefill_gates

        return prefill_gates(a, b)
    return a.contiguous(), b.float().sigmoid()


def load() -> FlaPrefill | None:
    """fla's prefill, or None when fla-core is not installed (or cannot load)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

        if not _DIRECT_ARGS <= set(inspect.signature(chunk_gated_delta_rule_fwd).parameters):
            raise ImportError("another fla forward signature")
    except Exception:
        return FlaPrefill(chunk_gated_delta_rule)
    return FlaPrefill(chunk_gated_delta_rule, chunk_gated_delta_rule_fwd, l2norm_fwd)
