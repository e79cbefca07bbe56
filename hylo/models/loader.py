"""Reading checkpoint files: one safetensors file, or shards listed in ``model.safetensors.index.json``."""

from __future__ import annotations

import json
import os

import torch

from ..layers.weights import CheckpointError, ReaderOver, TensorReader


def read_json(path: str):
    """A checkpoint's JSON file (config, index), or a CheckpointError naming the file and where its text stops
    being JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None


class SafetensorsReader(TensorReader):
    def __init__(self, path: str):
        super().__init__()
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            contents = read_json(index)
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index} has no weight_map of tensor names to shard files")
            files = sorted(set(weight_map.values()))
            outside = [fn for fn in files if os.path.basename(fn) != fn or fn in ("", ".", "..")]
            if outside:  # a shard is a file of the checkpoint's own folder, never a path out of it
                raise CheckpointError(f"{index} lists shard {outside[0]!r}, which is not a file name in {path!r}")
        elif os.path.isfile(single):
            weight_map, files = None, ["model.safetensors"]
        else:
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path!r}")
        self._handles = {}
        self._where: dict[str, str] = {}
        self.nbytes = 0  # the files' size
        for fn in files:
            full = os.path.join(path, fn)
            if not os.path.isfile(full):
                raise CheckpointError(f"checkpoint shard {fn!r} listed in the index is missing from {path!r}")
            try:
                h = safe_open(full, framework="pt")
            except Exception as e:  # safetensors' own error type: a truncated or corrupt file
                raise CheckpointError(f"checkpoint file {full!r} cannot be read as safetensors "
                                      f"({str(e).strip() or type(e).__name__})") from None
            self._handles[fn] = h
            self.nbytes += os.path.getsize(full)
            for k in h.keys():
                self._where[k] = fn
        if weight_map is not None:
            missing = [k for k, fn in weight_map.items() if k not in self._where]
            if missing:
                raise CheckpointError(f"tensor {missing[0]!r} listed in the index is not in its shard "
                                      f"{weight_map[missing[0]]!r}")

    def keys(self):
        return self._where.keys()

    def _load(self, name):
        return self._handles[self._where[name]].get_tensor(name)

    def shape_of(self, name):
        if name not in self._where:
            return super().shape_of(name)
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def dtype_of(self, name):
        """safetensors' dtype code ("BF16", "F8_E4M3", ...), from the file's header."""
        if name not in self._where:
            return super().dtype_of(name)
        return self._handles[self._where[name]].get_slice(name).get_dtype()

    def get_part(self, name, dim, start, stop):
        """Reads only the requested rows (or columns) from the file."""
        if name not in self._where:
            return super().get_part(name, dim, start, stop)
        self.used.add(name)
        part = self._handles[self._where[name]].get_slice(name)
        return part[(slice(None),) * dim + (slice(start, stop),)]


# safetensors' dtype codes as torch dtypes (a code not here is read as float32: the header check needs shapes)
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8, "U8": torch.uint8,
                 "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


class HeaderReader(ReaderOver):
    """A checkpoint's tensors as meta tensors of their stored shape and dtype, from the files' headers: loading a
    model built on the meta device through it checks every name and shape the model reads, and reads no weight
    (what it checked is its own ``used``, apart from the files' record)."""

    def __init__(self, files: SafetensorsReader):
        super().__init__(files, share_used=False)

    def _load(self, name):
        return torch.empty(self.shape_of(name), dtype=_TORCH_DTYPES.get(self.dtype_of(name), torch.float32),
                           device="meta")
