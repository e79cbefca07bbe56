"""Block-quantized FP8 weights, as Qwen and DeepSeek ship them: float8_e4m3fn values with one float scale per
``[bn, bk]`` block of the weight's last two dimensions (partial blocks at the right and bottom edges), stored as
``<name>_scale_inv`` beside ``<name>``. The stored scale multiplies: ``w ~= q * scale_inv`` over its block.

These are the torch references: on the CPU a checkpoint is dequantized through them at load; on a GPU its weights
stay ``Fp8Weight`` and the Triton kernels (``fp8_triton``) dequantize each block as they load it.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def kernel_tileable(block: tuple[int, int]) -> bool:
    """Whether the W8A16 kernels (the GEMV, the matmul, the MoE kernels) tile weights of this block: its columns a
    power of two of at least 16 (Qwen's are 128), so that a K tile lies inside one block."""
    return block[1] >= 16 and block[1] & (block[1] - 1) == 0


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of a weight's scale tensor: one entry per (possibly partial) block of its last two dims."""
    *lead, n, k = shape
    bn, bk = block
    return (*lead, -(-n // bn), -(-k // bk))


def expand_scales(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over the block's elements, cut to ``shape`` at the edges: every element's scale
    (the readers' scale maps)."""
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :shape[-2], :shape[-1]]


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weights from FP8 values and their per-block scales (any leading dims: fused experts)."""
    expected = scale_grid(tuple(q.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {list(scale_inv.shape)} does not match weight shape {list(q.shape)} with "
                         f"blocks {list(block)} (expected {list(expected)})")
    return q.to(torch.float32) * expand_scales(scale_inv.to(torch.float32), tuple(q.shape), block)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, float32 per-block scales) of ``w``: each block scaled so that its largest magnitude maps to the
    format's largest finite value (an all-zero block gets scale 1)."""
    *lead, n, k = w.shape
    bn, bk = block
    grid = scale_grid(tuple(w.shape), block)
    wf = w.to(torch.float32)
    padded = torch.zeros(*lead, grid[-2] * bn, grid[-1] * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = wf
    blocks = padded.unflatten(-1, (grid[-1], bk)).unflatten(-3, (grid[-2], bn))  # [..., gn, bn, gk, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., gn, gk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / expand_scales(scale, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Fp8Weight(torch.nn.Module):
    """A block-FP8 weight kept as it is stored (DESIGN.md section 12): ``q`` float8_e4m3fn [..., N, K] and
    ``scale`` float32 [..., ceil(N / bn), ceil(K / bk)]. The projections in ``ops.linear`` and ``ops.moe`` take it
    in place of a weight tensor: the fast kernels dequantize blocks as they load them; the reference paths
    dequantize the whole weight (``dequantize``). Indexing the leading dims gives a view (an expert's weight)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        self.q = torch.nn.Parameter(q, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.block = tuple(block)

    @classmethod
    def empty(cls, shape: tuple[int, ...], block: tuple[int, int], device=None) -> "Fp8Weight":
        return cls(torch.empty(shape, dtype=FP8_DTYPE, device=device),
                   torch.ones(scale_grid(tuple(shape), block), dtype=torch.float32, device=device), block)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __getitem__(self, index) -> "Fp8Weight":
        """A view of leading-dim entries (``w13[e]``, ``w13[:E]``) sharing this weight's memory."""
        return Fp8Weight(self.q[index], self.scale[index], self.block)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_block(self.q, self.scale, self.block).to(dtype)

    def extra_repr(self) -> str:
        return f"shape={list(self.q.shape)}, block={list(self.block)}"


def fp8_blocks_of(values: torch.Tensor, scale_map: torch.Tensor, block: tuple[int, int]):
    """(FP8 values, block scales) that reproduce ``values`` exactly, given each element's scale (``scale_map``,
    the checkpoint's block scales laid out like the weight after its re-layout at load), or None when the layout
    does not keep whole blocks together (a block straddling two scales, or unquantized rows). Since each value
    is q * s of an FP8 q, value / s rounds back to q exactly."""
    bn, bk = block
    if not bool((scale_map > 0).all()):
        return None
    scale = scale_map[..., ::bn, ::bk].contiguous()
    if not torch.equal(expand_scales(scale, tuple(values.shape), block), scale_map):
        return None
    q = (values.to(torch.float32) / scale_map).to(FP8_DTYPE)
    if not torch.equal(q.to(torch.float32) * scale_map, values.to(torch.float32)):
        return None  # values that were not FP8 times their scale (cannot happen for a checkpoint's own weights)
    return q, scale
