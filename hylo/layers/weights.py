"""The weight-reading interface the layers load through: ``get(name, shape)`` by checkpoint name.

A missing tensor or one of the wrong shape is an error that names it. The reader remembers which names were read,
so unexpected leftovers can be reported. The file formats live in ``models/loader.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..ops.fp8 import Fp8Weight, fp8_blocks_of


class CheckpointError(ValueError):
    """A checkpoint that does not match the model its config describes."""


class TensorReader:
    """Base: ``get(name, shape)`` returns a tensor or raises CheckpointError naming the problem."""

    def __init__(self):
        self.used: set[str] = set()

    def keys(self) -> Iterable[str]:
        raise NotImplementedError

    def _load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self._key_set

    @property
    def _key_set(self) -> set[str]:
        if not hasattr(self, "_keys_cache"):
            self._keys_cache = set(self.keys())
        return self._keys_cache

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if not self.has(name):
            raise CheckpointError(f"checkpoint is missing tensor {name!r}"
                                  + (f" (expected shape {list(shape)})" if shape is not None else ""))
        t = self._load(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"checkpoint tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                                  f"from config.json")
        self.used.add(name)
        return t

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The stored shape, without marking the tensor read."""
        return tuple(self._load(name).shape)

    def dtype_of(self, name: str) -> str:
        """The stored dtype's name (torch's, e.g. "bfloat16"; a file reader may give its format's code instead,
        e.g. safetensors' "BF16"), without marking the tensor read."""
        return str(self._load(name).dtype).removeprefix("torch.")

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` along ``dim``; readers that can read part of a tensor override this so that a
        tensor-parallel rank never loads more than its slice."""
        return self.get(name).narrow(dim, start, stop - start)

    def unused(self, ignore_prefixes: tuple[str, ...] = ()) -> list[str]:
        return sorted(k for k in self.keys() if k not in self.used and not k.startswith(ignore_prefixes))

    def scale_maps(self) -> "TensorReader | None":
        """A reader of the same names whose tensors are each element's block-FP8 scale (0 where not quantized),
        for re-laying a weight's scales exactly as its values are re-laid; None: nothing here is quantized."""
        return None


class ReaderOver(TensorReader):
    """A reader that wraps another: the same names, stored shapes and dtypes; ``get`` is the wrapper's own. With
    ``share_used`` (the default) what it reads is recorded in the inner reader's set, so ``unused`` is one answer
    for both."""

    def __init__(self, inner: TensorReader, share_used: bool = True):
        super().__init__()
        self.inner = inner
        if share_used:
            self.used = inner.used

    def keys(self):
        return self.inner.keys()

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.inner.shape_of(name)

    def dtype_of(self, name: str) -> str:
        return self.inner.dtype_of(name)


class DictReader(TensorReader):
    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def _load(self, name):
        return self.tensors[name]


def copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (casting to its dtype and device)."""
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype))


def proj_weight(shape: tuple[int, ...], dtype: torch.dtype, fp8_block: tuple[int, int] | None,
                device=None) -> "nn.Parameter | Fp8Weight":
    """An unloaded projection weight: in ``dtype``, or block FP8 when the checkpoint's FP8 weights stay FP8 in
    memory (``fp8_block``, see ``models.quant.keep_fp8``)."""
    if fp8_block is None:
        return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    return Fp8Weight.empty(shape, fp8_block, device)


def fp8_block_of(mc) -> tuple[int, int] | None:
    """The block of FP8 weights kept in memory for a model config, or None (weights in the compute dtype)."""
    q = mc.quantization
    return q.block if q is not None and q.keep else None


def load_proj(module: nn.Module, attr: str, r: TensorReader, read: Callable[[TensorReader], torch.Tensor],
              dtype: torch.dtype) -> None:
    """Load ``module.attr`` with ``read(r)`` (a family's re-layout of checkpoint tensors). An FP8 target takes the
    FP8 values and block scales that reproduce the values exactly (``read`` applied to the reader's scale maps
    gives the scales in the same layout); a weight the checkpoint does not quantize, or whose re-layout splits its
    blocks, becomes a ``dtype`` weight instead."""
    target = getattr(module, attr)
    if isinstance(target, torch.Tensor):
        copy_into(target, read(r))
        return
    values, maps = read(r), r.scale_maps()
    packed = fp8_blocks_of(values, read(maps), target.block) if maps is not None else None
    if packed is None:
        delattr(module, attr)
        setattr(module, attr, nn.Parameter(values.to(dtype=dtype, device=target.device), requires_grad=False))
        return
    with torch.no_grad():
        target.q.copy_(packed[0])
        target.scale.copy_(packed[1])


def keep_plain(module: nn.Module, attr: str, dtype: torch.dtype) -> None:
    """Replace an unloaded FP8 weight by an unloaded ``dtype`` one of its shape (the checkpoint stores it
    unquantized)."""
    target = getattr(module, attr)
    if not isinstance(target, torch.Tensor):
        delattr(module, attr)
        setattr(module, attr, proj_weight(tuple(target.shape), dtype, None, target.device))


def load_fp8_part(target: Fp8Weight, values: torch.Tensor, scale_map: torch.Tensor, name: str) -> None:
    """Load one part of an FP8 weight (an expert's rows of the experts' weight): its values must be the
    checkpoint's FP8 blocks, in the same layout."""
    packed = fp8_blocks_of(values, scale_map, target.block)
    if packed is None:
        raise CheckpointError(f"checkpoint tensor {name!r} is not block-FP8 in the layout hylo keeps it in memory "
                              f"(blocks {list(target.block)}); load the model with HYLO_FP8_WEIGHTS=dequantize")
    with torch.no_grad():
        target.q.copy_(packed[0])
        target.scale.copy_(packed[1])
