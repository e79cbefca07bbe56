"""The weight-reading interface the layers load through: ``get(name, shape)`` by checkpoint name.

A missing tensor or one of the wrong shape is an error that names it. The reader remembers which names were read,
so unexpected leftovers can be reported. The file formats live in ``models/loader.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
        return tuple(self.get(name).shape)

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
