"""Loading a model for an engine: the device and dtype a user asked for, and the model itself from a checkpoint
directory, a Hub id, the embedded default (trained, or random weights) or a benchmark's model source, sharded
under tensor parallelism; what it returns (``LoadedModel``) is what an ``Engine`` is built from."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace

import torch

from ..config import ModelConfig
from ..layers.weights import DictReader, TensorReader
from ..models.default import (DEFAULT_MODEL_NAME, DEFAULT_SEED, TRAINED_DEFAULT_NAME, default_model_config,
                              trained_default_path)
from ..models.hub import looks_like_repo_id, resolve as resolve_model
from ..models.causal_lm import CausalLM
from ..models.loader import HeaderReader, SafetensorsReader
from ..models.quant import keep_fp8, quantized_reader
from ..models.random_init import random_checkpoint
from ..models.registry import build_model, build_mtp, family_of, read_config, untie_where_the_head_differs
from ..parallel.group import SINGLE, TPGroup
from ..parallel.sharding import ShardedReader, local_config
from ..tokenizer import ByteTokenizer, load_tokenizer


def resolve_device(device: str | torch.device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's message lists every device type it knows
        raise ValueError(f"unsupported device {device!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: use 'cpu', 'cuda' or 'auto'")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise ValueError(f"unsupported device {device!r}: the CPU has no index here, use 'cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}: use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return names[dtype]


# Checkpoints from this size on are checked from their headers before any weight is read (``check_shapes``). The
# check's first run imports torch's Python meta kernels (about 2 s); a smaller checkpoint loads in about that
# time and meets the same errors while loading.
HEADER_CHECK_MIN_BYTES = 1 << 30


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: CausalLM
    reader: TensorReader
    tokenizer: object | None
    is_random: bool
    local_config: ModelConfig | None = None  # this rank's shard under tensor parallelism (else ``config``)

    @property
    def shard_config(self) -> ModelConfig:
        return self.local_config or self.config


def load_model(path: str | None, dtype: torch.dtype, device: torch.device, progress: bool = False,
               tp: TPGroup = SINGLE, mtp: bool = False) -> LoadedModel:
    """A checkpoint directory; None for the embedded default (the trained one when it ships, else random weights);
    ``"hylo-default-random"`` for the random-weight default. ``mtp``: the MTP head will be loaded too (its tensors
    are checked with the model's before any weight is read)."""
    if path is not None and not isinstance(path, str) and hasattr(path, "load"):  # a model source (benchmarks)
        return path.load(dtype, device, tp)
    display_name = None
    if path is None and trained_default_path() is not None:
        path, display_name = trained_default_path(), TRAINED_DEFAULT_NAME
    if path is None or (path == DEFAULT_MODEL_NAME and not os.path.isdir(path)):
        mc = default_model_config()
        reader: TensorReader = DictReader(random_checkpoint(mc, seed=DEFAULT_SEED))
        name, tokenizer, is_random = DEFAULT_MODEL_NAME, ByteTokenizer(), True
    else:
        # a Hub id is the model's name as clients know it (vLLM serves it so); a directory its last part
        name = path if looks_like_repo_id(path) else os.path.basename(os.path.normpath(path))
        path = resolve_model(path)  # a directory, or a Hub id through the local cache (a download when online)
        mc = read_config(path)
        files = SafetensorsReader(path)
        reader = quantized_reader(files, mc.quantization)  # headers checked, nothing read yet
        mc = untie_where_the_head_differs(mc, reader)
        if files.nbytes >= HEADER_CHECK_MIN_BYTES:
            t0, headers = time.perf_counter(), HeaderReader(files)
            check_shapes(headers, mc, dtype, tp, mtp)
            if progress:
                print(f"[hylo] {len(headers.used)} tensors checked against config.json from the files' headers "
                      f"({time.perf_counter() - t0:.1f}s); loading {files.nbytes / 2**30:.1f} GiB", file=sys.stderr,
                      flush=True)
        if mc.quantization is not None and keep_fp8(device, mc.quantization.block):  # FP8 in memory (GPU)
            mc = replace(mc, quantization=replace(mc.quantization, keep=True))
        name = display_name or name
        tokenizer, is_random = load_tokenizer(path), False
    local = local_config(mc, tp.size)
    reader = _rank_reader(reader, mc, tp)
    with torch.device(device):
        model = build_model(local, dtype, device, tp)
    model.load(reader, progress=progress and not is_random)
    model.eval()
    return LoadedModel(name, mc, model, reader, tokenizer, is_random, local)


def _rank_reader(reader: TensorReader, mc: ModelConfig, tp: TPGroup) -> TensorReader:
    """Under tensor parallelism each rank reads only its slice of every tensor."""
    return ShardedReader(reader, mc, tp.rank, tp.size) if tp.size > 1 else reader


def check_shapes(headers: HeaderReader, mc: ModelConfig, dtype: torch.dtype, tp: TPGroup, mtp: bool) -> None:
    """Load this rank's model (and with ``mtp`` its MTP head) built on the meta device from the checkpoint's
    headers alone: a tensor that is missing or not of the shape the config gives is a CheckpointError naming it
    before any weight is read, not after half the model has loaded. A block-FP8 weight is taken as it is stored:
    the headers have no scale maps, so the layers load every weight in the compute dtype (the same names and
    shapes; the scales' shapes are ``quant.check_tensors``' to check)."""
    reader = _rank_reader(headers, mc, tp)
    local, meta = local_config(mc, tp.size), torch.device("meta")
    with meta:
        model = build_model(local, dtype, meta, tp)
    model.load(reader)
    if mtp:  # (a checkpoint without a head is refused here too, by build_mtp)
        with meta:
            head = build_mtp(local, model, dtype, meta)
        head.load(reader)


def print_load_notes(lm: LoadedModel, dtype: torch.dtype) -> None:
    """Start-up notes on what a checkpoint holds beyond the model hylo built: the parts a family leaves out (a
    vision tower), tensors nothing read, and how block-FP8 weights are kept."""
    ignored = family_of(lm.config.model_type).ignored
    for prefix, what in ignored:
        count = sum(1 for k in lm.reader.keys() if k.startswith(prefix))
        if count:
            print(f"[hylo] {what} ({count} tensors under {prefix}*) is not loaded: hylo serves the text "
                  f"model, and refuses requests with image or video content", file=sys.stderr)
    unused = lm.reader.unused(ignore_prefixes=("mtp.",) + tuple(p for p, _ in ignored))
    if unused:
        print(f"[hylo] warning: {len(unused)} checkpoint tensors not used, e.g. {unused[0]!r}", file=sys.stderr)
    if lm.config.quantization is not None:
        q, dt = lm.config.quantization, str(dtype).removeprefix("torch.")
        fp8 = sum(p.numel() for p in lm.model.parameters() if p.dtype == torch.float8_e4m3fn)
        count = f"{fp8 / 1e9:.2f} B" if fp8 >= 1e8 else f"{fp8 / 1e6:.2f} M"
        how = (f"{count} weights kept in FP8 ({fp8 / 2**30:.2f} GiB), dequantized by the kernels as they load them"
               if q.keep else f"weights dequantized to {dt} at load")
        print(f"[hylo] block-FP8 checkpoint ({q.block[0]}x{q.block[1]} blocks): {how}", file=sys.stderr)


def print_model_line(lm: LoadedModel, dtype: torch.dtype, device: torch.device, seconds: float) -> None:
    """The start-up line naming the model, where its weights came from (random ones said loudly), and its size."""
    if lm.is_random:  # the embedded default untrained, or a benchmark shape
        kind = ("embedded default, " if lm.name == DEFAULT_MODEL_NAME else "") + "RANDOM WEIGHTS (output is noise)"
    elif lm.name == TRAINED_DEFAULT_NAME:
        kind = "embedded default, trained on the Python standard library"
    else:
        kind = "checkpoint"
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    print(f"[hylo] model {lm.name} ({kind}) on {device} in {str(dtype)[6:]}, weights {weights / 2**30:.2f} GiB, "
          f"loaded in {seconds:.1f}s", file=sys.stderr, flush=True)
