"""Write a block-FP8 copy of a bfloat16 / float16 / float32 checkpoint, in the layout Qwen's FP8 releases use:
the projections of attention, GDN and the MLPs / experts (per-expert or fused, MTP layers too unless --keep-mtp)
become float8_e4m3fn with a float32 ``<name>_scale_inv`` per [bn, bk] block; embeddings, the LM head, routers,
norms, the conv, the GDN's small a/b projections and any vision tower stay as they are, listed in the config's
``modules_to_not_convert``. Shards keep their names; everything else in the directory is copied.

    python tools/quantize_fp8.py DIR OUT [--block 128 128] [--keep-mtp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

def quantizable(name: str, tensor: torch.Tensor, keep_mtp: bool) -> bool:
    from hylo.models.quant import fp8_quantizable

    if not tensor.is_floating_point() or (keep_mtp and name.startswith("mtp.")):
        return False
    return fp8_quantizable(name, tensor.dim())


def check_paths(src: str, dst: str, force: bool = False) -> dict:
    """The source's config, after refusing (SystemExit, one line) what cannot be converted or written: a source
    that is not a checkpoint directory, an output that is the source, a file, or a non-empty directory (unless
    ``force``: its checkpoint files are then removed first, so that no stale shard stays beside the new ones)."""
    if not os.path.isdir(src):
        raise SystemExit(f"{src}: not a directory (a checkpoint directory with config.json is needed)")
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        raise SystemExit(f"{src}: no config.json")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise SystemExit(f"{cfg_path} must hold a JSON object")
    if config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config"):
        raise SystemExit(f"{src} is already quantized ({config.get('quantization_config')})")
    if not (os.path.isfile(os.path.join(src, "model.safetensors.index.json"))
            or os.path.isfile(os.path.join(src, "model.safetensors"))):
        raise SystemExit(f"no model.safetensors or model.safetensors.index.json in {src}")
    if os.path.exists(dst):  # (after every check of the source: --force removes files only for a convertible one)
        if not os.path.isdir(dst):
            raise SystemExit(f"{dst} exists and is not a directory")
        if os.path.samefile(src, dst):
            raise SystemExit(f"{dst} is the source directory: write the FP8 copy somewhere else")
        entries = os.listdir(dst)
        if entries and not force:
            raise SystemExit(f"{dst} is not empty ({len(entries)} entries): give an empty or new directory, or "
                             f"--force to replace its checkpoint files")
        for entry in entries:
            if entry == "config.json" or entry.endswith((".safetensors", ".safetensors.index.json")):
                os.remove(os.path.join(dst, entry))
    return config


def quantize_checkpoint(src: str, dst: str, block: tuple[int, int], keep_mtp: bool = False,
                        log=print, force: bool = False) -> dict:
    """Write the FP8 copy of ``src`` to ``dst``; returns counts (tensors quantized and kept, bytes before/after)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hylo.ops.fp8 import quantize_fp8_block

    config = check_paths(src, dst, force)
    index_path = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        shards = sorted(set(index["weight_map"].values()))
    elif os.path.isfile(os.path.join(src, "model.safetensors")):
        index, shards = None, ["model.safetensors"]
    else:
        raise SystemExit(f"no model.safetensors or model.safetensors.index.json in {src}")
    os.makedirs(dst, exist_ok=True)
    weight_map, kept_modules = {}, []
    stats = dict(quantized=0, kept=0, bytes_in=0, bytes_out=0)
    for i, shard in enumerate(shards):
        out = {}
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                stats["bytes_in"] += t.numel() * t.element_size()
                if quantizable(name, t, keep_mtp):
                    q, scale = quantize_fp8_block(t, block)
                    out[name], out[name + "_scale_inv"] = q, scale
                    stats["quantized"] += 1
                else:
                    out[name] = t.contiguous()
                    stats["kept"] += 1
                    if name.endswith(".weight") and t.dim() == 2 and "norm" not in name:
                        kept_modules.append(name[:-len(".weight")])
        for name in out:
            weight_map[name] = shard
            stats["bytes_out"] += out[name].numel() * out[name].element_size()
        save_file(out, os.path.join(dst, shard), metadata={"format": "pt"})
        log(f"[quantize] shard {i + 1}/{len(shards)} {shard}: {stats['quantized']} tensors quantized so far")
    if index is not None:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": stats["bytes_out"]}, "weight_map": weight_map}, f, indent=2)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": sorted(kept_modules)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for entry in os.listdir(src):
        if entry in ("config.json", "model.safetensors.index.json") or entry in shards:
            continue
        full = os.path.join(src, entry)
        if os.path.isfile(full):
            shutil.copy2(full, os.path.join(dst, entry))
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="checkpoint directory (config.json and safetensors)")
    ap.add_argument("dst", help="output directory")
    ap.add_argument("--block", type=int, nargs=2, default=(128, 128), metavar=("BN", "BK"),
                    help="block rows and columns (default 128 128, as Qwen's releases)")
    ap.add_argument("--keep-mtp", action="store_true", help="leave the MTP head's weights unquantized")
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty output directory (its checkpoint files are removed first)")
    args = ap.parse_args(argv)
    if min(args.block) <= 0:
        ap.error("--block sizes must be positive")
    stats = quantize_checkpoint(args.src, args.dst, tuple(args.block), args.keep_mtp,
                                log=lambda m: print(m, file=sys.stderr, flush=True), force=args.force)
    print(f"{stats['quantized']} tensors quantized, {stats['kept']} kept; "
          f"{stats['bytes_in'] / 2**20:.1f} MiB -> {stats['bytes_out'] / 2**20:.1f} MiB in {args.dst}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    raise SystemExit(main())
