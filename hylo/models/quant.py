"""Quantized checkpoints: what ``quantization_config`` hylo serves, the checks that refuse the rest before any weight
is read, and the reader that dequantizes block-FP8 weights as the layers load them.

Served: block FP8 as Qwen and DeepSeek release it (``quant_method: fp8``, ``weight_block_size: [bn, bk]``,
float8_e4m3fn weights with a ``<name>_scale_inv`` of one scale per block, dynamic activations). On the CPU the
weights are dequantized at load into the compute dtype (the torch reference of ``ops.fp8``), so the model computes
what transformers computes from the same files; on a GPU they stay FP8 with their scales (``keep_fp8``) and the
kernels dequantize each block as they load it (``ops.fp8_triton``). Anything else that is quantized (another method,
per-tensor FP8,
static activation scales, UE8M0 scales, or quantized tensors without a ``quantization_config``) is an error that
names it: a checkpoint hylo cannot run correctly never loads.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from ..config import QuantConfig
from ..layers.weights import CheckpointError, ReaderOver, TensorReader
from ..ops.fp8 import dequantize_fp8_block, expand_scales, kernel_tileable, scale_grid

SCALE_SUFFIX = "_scale_inv"
# tensor names that only quantized checkpoints have (GPTQ/AWQ, bitsandbytes, compressed-tensors, FP8, MXFP4)
_QUANTIZED_NAME = re.compile(r"(_scale_inv|\.weight_scale|\.input_scale|\.activation_scale|\.qweight|\.qzeros|"
                             r"\.scales|\.g_idx|\.SCB|\.absmax|\.quant_map|\.weight_packed|_blocks|_scales)$")
# storage dtypes of quantized values (safetensors' codes and torch's names)
_LOW_PRECISION = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I8", "U8", "float8_e4m3fn", "float8_e5m2",
                  "float8_e8m0fnu", "int8", "uint8"}
_FP8 = {"F8_E4M3", "float8_e4m3fn"}
# dtypes block-FP8 scales are read in (integer or UE8M0 bytes would be multiplied in as the numbers they store)
_SCALE_DTYPES = {"F32", "BF16", "F16", "F64", "float32", "bfloat16", "float16", "float64"}
# dtypes no weight has (int8 / uint8 are quantized values, above); the buffers some checkpoints carry in them
_NOT_WEIGHTS = {"BOOL", "I16", "U16", "I32", "U32", "I64", "U64", "bool", "int16", "int32", "int64", "uint16",
                "uint32", "uint64"}
_BUFFER_NAME = re.compile(r"(position_ids|num_batches_tracked|\.mask)$")

# the weights Qwen's FP8 releases quantize (under model., model.language_model. or mtp.): attention, GDN and MLP /
# expert projections; embeddings, the LM head, routers, norms, the conv, the GDN's a/b rows and vision stay as they are
FP8_QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)|"
                           r"mlp\.(shared_expert\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$"
                           r"|\.mlp\.experts\.(gate_up_proj|down_proj)$")
_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")


def fp8_quantizable(name: str, ndim: int = 2) -> bool:
    """Whether a tensor of this name is one the FP8 releases (and ``tools/quantize_fp8.py``) store in FP8."""
    return ndim >= 2 and not _VISION.search(name) and FP8_QUANTIZED.search(name) is not None


SUPPORTED = "bfloat16, float16 and float32 checkpoints, and block FP8 (quant_method 'fp8' with weight_block_size)"


def parse_quantization(cfg: dict[str, Any]) -> QuantConfig | None:
    """``config.json``'s ``quantization_config`` (top level, or the text model's) as a QuantConfig; None when the
    checkpoint is not quantized. A method or option hylo does not run is a ValueError naming it."""
    qc = cfg.get("quantization_config")
    inner = cfg["text_config"].get("quantization_config") if isinstance(cfg.get("text_config"), dict) else None
    if qc is not None and inner is not None and qc != inner:
        raise ValueError("config.json: quantization_config and text_config.quantization_config disagree: the "
                         "checkpoint's quantization is ambiguous")
    qc = inner if qc is None else qc
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"config.json: quantization method {method!r} is not supported; hylo runs {SUPPORTED}")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("config.json: FP8 without weight_block_size (per-tensor or per-channel scales) is not "
                         f"supported; hylo runs {SUPPORTED}")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"config.json: weight_block_size must be two positive integers, got {block!r}")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"config.json: FP8 format {fmt!r} is not supported (only e4m3)")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"config.json: FP8 scale format {scale_fmt!r} is not supported (only float scales)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"config.json: FP8 activation_scheme {scheme!r} is not supported (only 'dynamic')")
    return QuantConfig("fp8", (int(block[0]), int(block[1])))


def check_tensors(reader: TensorReader, quant: QuantConfig | None) -> None:
    """Refuse, from names, shapes and dtypes alone (no weight is read), a checkpoint whose tensors do not match its
    quantization_config: quantized tensors without one, FP8 weights without their scales, scales of the wrong grid."""
    names = list(reader.keys())
    kinds = {name: reader.dtype_of(name) for name in names}  # from the headers, once: each name is asked below
    present = set(names)
    for name, kind in kinds.items():  # integers or booleans cast to a float weight would load without a word
        if kind in _NOT_WEIGHTS and not _BUFFER_NAME.search(name):
            raise CheckpointError(f"checkpoint tensor {name!r} is stored as {kind}: hylo reads weights of a floating "
                                  f"point dtype ({SUPPORTED})")
    if quant is None:
        for name in names:
            if _QUANTIZED_NAME.search(name) or kinds[name] in _LOW_PRECISION:
                raise CheckpointError(f"checkpoint tensor {name!r} ({kinds[name]}) is quantized, but "
                                      f"config.json has no quantization_config; hylo runs {SUPPORTED}")
        return
    for name in names:
        if name.endswith(SCALE_SUFFIX):
            weight = name[:-len(SCALE_SUFFIX)]
            if weight not in present:
                raise CheckpointError(f"checkpoint has the FP8 scales {name!r} but not their weight {weight!r}")
            if kinds[weight] not in _FP8:
                raise CheckpointError(f"checkpoint tensor {weight!r} has FP8 scales but is {kinds[weight]}"
                                      f", not float8_e4m3fn")
            if kinds[name] not in _SCALE_DTYPES:
                raise CheckpointError(f"checkpoint tensor {name!r} is stored as {kinds[name]}: hylo reads block-FP8 "
                                      f"scales of a float dtype (integer or UE8M0 scales are not supported)")
            if len(reader.shape_of(weight)) < 2:
                raise CheckpointError(f"checkpoint tensor {weight!r} of shape {list(reader.shape_of(weight))} is "
                                      f"{kinds[weight]} with scales: block FP8 quantizes matrices, not vectors")
            grid = scale_grid(reader.shape_of(weight), quant.block)
            if reader.shape_of(name) != grid:
                raise CheckpointError(f"checkpoint tensor {name!r} has shape {list(reader.shape_of(name))}; weight "
                                      f"{weight!r} of shape {list(reader.shape_of(weight))} in "
                                      f"{list(quant.block)} blocks needs {list(grid)}")
        elif _QUANTIZED_NAME.search(name):
            raise CheckpointError(f"checkpoint tensor {name!r} belongs to a quantization scheme hylo does not run "
                                  f"(block FP8 has only '{SCALE_SUFFIX}' scales)")
        elif kinds[name] in _LOW_PRECISION and name + SCALE_SUFFIX not in present:
            raise CheckpointError(f"checkpoint tensor {name!r} is {kinds[name]} without its scales "
                                  f"{name + SCALE_SUFFIX!r}")


class Fp8BlockReader(ReaderOver):
    """Wraps a checkpoint's reader: a weight with block-FP8 scales is returned dequantized (float32, cast to the
    parameter's dtype as it is copied in); every other tensor as it is stored. Reading a weight marks its scales
    read too."""

    def __init__(self, inner: TensorReader, block: tuple[int, int]):
        super().__init__(inner)
        self.block = block

    def quantized(self, name: str) -> bool:
        return self.inner.has(name + SCALE_SUFFIX)

    def _load(self, name: str) -> torch.Tensor:
        if not self.quantized(name):
            return self.inner.get(name)
        return dequantize_fp8_block(self.inner.get(name), self.inner.get(name + SCALE_SUFFIX), self.block)

    def dtype_of(self, name: str) -> str:
        return "float32" if self.quantized(name) else self.inner.dtype_of(name)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if not self.quantized(name):
            return self.inner.get_part(name, dim, start, stop)
        return self.get(name).narrow(dim, start, stop - start)

    def scale_maps(self) -> "ScaleMapReader":
        return ScaleMapReader(self)


class ScaleMapReader(ReaderOver):
    """The scale of every element of each weight of an ``Fp8BlockReader`` (float32, the weight's shape; 0 for an
    unquantized tensor): a weight's re-layout at load applied to these gives its scales in the same layout. (Its
    own record of reads: a scale map read is not the weight read.)"""

    def __init__(self, fp8: Fp8BlockReader):
        super().__init__(fp8, share_used=False)
        self.fp8 = fp8

    def _load(self, name: str) -> torch.Tensor:
        shape = self.fp8.shape_of(name)
        if not self.fp8.quantized(name):
            return torch.zeros(shape)
        return expand_scales(self.fp8.inner.get(name + SCALE_SUFFIX).to(torch.float32), shape, self.fp8.block)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.get(name).narrow(dim, start, stop - start)


def keep_fp8(device, block: tuple[int, int] = (128, 128)) -> bool:
    """Whether block-FP8 weights stay FP8 in memory on ``device`` (DESIGN.md section 12: on the GPU, where the
    kernels dequantize as they load; on the CPU the reference dequantizes at load). ``HYLO_FP8_WEIGHTS``: "auto"
    (the default), "keep" or "dequantize". "auto" keeps only blocks the kernels tile (columns a power of two of at
    least 16, as every release's 128): any other block would be dequantized whole at every step."""
    mode = os.environ.get("HYLO_FP8_WEIGHTS", "auto")
    if mode not in ("auto", "keep", "dequantize"):
        raise ValueError(f"HYLO_FP8_WEIGHTS={mode!r}: expected 'auto', 'keep' or 'dequantize'")
    return mode == "keep" or (mode == "auto" and torch.device(device).type == "cuda" and kernel_tileable(block))


def quantized_reader(reader: TensorReader, quant: QuantConfig | None) -> TensorReader:
    """``reader`` checked against ``quant`` and, for block FP8, wrapped to dequantize at load."""
    check_tensors(reader, quant)
    return reader if quant is None else Fp8BlockReader(reader, quant.block)
