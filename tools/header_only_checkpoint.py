"""A checkpoint of a benchmark shape with headers and no data: each tensor hylo reads, named and shaped as the
releases store it (block FP8 where they quantize, with its scales), in shards of about 4 GB whose data are holes
of a sparse file (a few MB on disk). For timing what reads only headers, the load's header check above all:
    python tools/header_only_checkpoint.py OUT [--model-name qwen3-next-80b-a3b-fp8]
    python tools/header_only_checkpoint.py OUT --time   # then times the header check on it
Loading it for real would read zeros (a model of zero weights)."""

import argparse
import dataclasses
import json
import os
import struct
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hylo.bench.shapes import bench_config, canonical_name  # noqa: E402
from hylo.engine.loading import check_shapes  # noqa: E402
from hylo.models.loader import HeaderReader, SafetensorsReader  # noqa: E402
from hylo.models.quant import fp8_quantizable, quantized_reader  # noqa: E402
from hylo.models.random_init import RandomReader  # noqa: E402
from hylo.models.registry import build_model, build_mtp, read_config  # noqa: E402
from hylo.ops.fp8 import scale_grid  # noqa: E402
from hylo.parallel.group import SINGLE  # noqa: E402

SHARD_BYTES = 4e9


class _Shapes(RandomReader):
    """Records the name and shape of every tensor a model asks for (experts one by one, as releases store them)."""

    def __init__(self):
        super().__init__(0, "cpu")
        self.shapes: dict[str, tuple[int, ...]] = {}

    def get(self, name, shape=None):
        self.shapes[name] = tuple(shape)
        self.used.add(name)
        return torch.empty(shape, device="meta")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write(out: str, model_name: str) -> dict:
    """Returns the headers written, name -> (dtype, shape)."""
    from transformers import Qwen3NextConfig

    if not canonical_name(model_name).startswith("qwen3-next-80b"):
        raise SystemExit("only the Qwen3-Next-80B-A3B shapes for now (transformers' Qwen3NextConfig defaults)")
    mc = bench_config(canonical_name(model_name))
    os.makedirs(out, exist_ok=True)
    cfg = Qwen3NextConfig().to_dict()  # (its defaults are the 80B-A3B release's shape)
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    if mc.quantization is not None:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": list(mc.quantization.block)}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    mc = read_config(out)
    plain = dataclasses.replace(mc, quantization=None)
    with torch.device("meta"):
        model = build_model(plain, torch.bfloat16, torch.device("meta"), SINGLE)
    rec = _Shapes()
    model.load(rec)
    with torch.device("meta"):
        head = build_mtp(plain, model, torch.bfloat16, torch.device("meta"))
    head.load(rec)
    headers = {}
    for name, shape in sorted(rec.shapes.items()):
        if mc.quantization is not None and fp8_quantizable(name, len(shape)):
            headers[name] = ("F8_E4M3", shape, _numel(shape))
            grid = scale_grid(shape, mc.quantization.block)
            headers[name + "_scale_inv"] = ("F32", grid, 4 * _numel(grid))
        else:
            headers[name] = ("BF16", shape, 2 * _numel(shape))
    shards, cur, size = [], {}, 0
    for name, (dtype, shape, nbytes) in headers.items():
        if cur and size + nbytes > SHARD_BYTES:
            shards.append((cur, size))
            cur, size = {}, 0
        cur[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [size, size + nbytes]}
        size += nbytes
    shards.append((cur, size))
    weight_map = {}
    for i, (shard, size) in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        blob = json.dumps(shard).encode()
        blob += b" " * (-len(blob) % 8)
        with open(os.path.join(out, fn), "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            f.truncate(8 + len(blob) + size)  # the data: a hole
        weight_map.update(dict.fromkeys(shard, fn))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    total = sum(size for _, size in shards)
    print(f"{out}: {len(headers)} tensors, {total / 1e9:.1f} GB in {len(shards)} sparse shards", flush=True)
    return headers


def time_check(path: str) -> None:
    t = time.perf_counter()
    mc, files = read_config(path), SafetensorsReader(path)
    quantized_reader(files, mc.quantization)
    print(f"headers opened and checked: {time.perf_counter() - t:.2f} s")
    for run in ("first (imports torch's meta kernels)", "again"):
        t = time.perf_counter()
        check_shapes(HeaderReader(files), mc, torch.bfloat16, SINGLE, mtp=True)
        print(f"header check with the MTP head, {run}: {time.perf_counter() - t:.2f} s")


def main():
    from gpu_only import require

    require("tools/header_only_checkpoint.py", cuda=False, modules=("transformers",))
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model-name", default="qwen3-next-80b-a3b-fp8")
    ap.add_argument("--time", action="store_true", help="then time the load's header check on it")
    args = ap.parse_args()
    write(args.out, args.model_name)
    if args.time:
        time_check(args.out)


if __name__ == "__main__":
    main()
