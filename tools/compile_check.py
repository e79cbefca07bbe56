"""Compile every Triton kernel a model step launches for a real GPU target, without a GPU.

Phase 1 runs generation through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``) and records each launch:
the kernel, its argument types, its constexpr values and launch options. Phase 2 (a fresh process, the kernels as
normal JIT functions) compiles each distinct launch ahead of time for the target (default sm_90, the H200) with
Triton's bundled ptxas, four ways: as recorded (float32, the interpreter's dtype), with the float32 pointers as
bfloat16 (the production dtype), and each with programmatic dependent launch on when the kernel supports it.
Catches what the interpreter cannot: register / shared-memory limits, layouts, GPU-only instructions.

Usage (needs the ``triton`` package, no GPU):
    python tools/compile_check.py [--checkpoint DIR] [--spec mtp] [--arch 90]
An FP8 checkpoint's kernels are recorded only with ``HYLO_FP8_WEIGHTS=keep`` (on the CPU its weights are otherwise
dequantized at load: no FP8 launch to record). The default checkpoint is the embedded random model; pass a checkpoint
of the production shapes (for example one
written by ``random_checkpoint`` with bench-6b's sizes and fewer layers) to check the launch configurations that
matter.
"""

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg")
TORCH_TO_TRITON = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int64": "i64",
                   "torch.int32": "i32", "torch.bool": "i1", "torch.uint8": "u8", "torch.int8": "i8",
                   "torch.float8_e4m3fn": "fp8e4nv"}


def _is_constexpr(param) -> bool:
    ann = param.annotation
    return ann is not inspect.Parameter.empty and "constexpr" in (ann if isinstance(ann, str) else repr(ann))


def record(checkpoint: str | None, spec: str | None, out: str) -> None:
    """Phase 1 (under the interpreter): generate a few tokens and write the distinct launches to ``out``."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    launches = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        sig = inspect.signature(self.fn)
        opts = {k: kwargs.pop(k) for k in list(kwargs) if k in LAUNCH_OPTIONS}
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        entry = {"module": self.fn.__module__, "kernel": self.fn.__name__, "options": opts, "args": {}}
        for name, value in bound.arguments.items():
            if _is_constexpr(sig.parameters[name]):
                entry["args"][name] = ["constexpr", value if not isinstance(value, torch.dtype) else str(value)]
            elif isinstance(value, torch.Tensor):
                entry["args"][name] = ["ptr", TORCH_TO_TRITON[str(value.dtype)]]
            elif isinstance(value, bool):
                entry["args"][name] = ["scalar", "i1"]
            elif isinstance(value, int) and value == 1:
                # the JIT specialises an integer argument equal to 1 into the constant 1 (the interpreter does
                # not): code that treats it as a tensor (``B.to(...)``) fails to compile only then
                entry["args"][name] = ["constexpr", 1]
            elif isinstance(value, int):
                entry["args"][name] = ["scalar", "i64" if abs(value) >= 2 ** 31 else "i32"]
            elif isinstance(value, float):
                entry["args"][name] = ["scalar", "fp32"]
            else:
                entry["args"][name] = ["constexpr", value]
        launches[json.dumps(entry, sort_keys=True)] = entry
        return original(self, *args, grid=grid, warmup=warmup, **kwargs, **opts)

    InterpretedFunction.run = run
    from hylo.api import LLM
    from hylo.sampling_params import SamplingParams

    options = {"speculative": spec, "num_speculative_tokens": 3} if spec else {}
    llm = LLM(checkpoint or "hylo-default-random", device="cpu", dtype="float32", verbose=False, max_num_seqs=4,
              max_model_len=512, kv_cache_tokens=4096, **options)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size  # a test checkpoint's vocabulary may be small
    llm.generate([[t % vocab for t in p] for p in ([5, 9, 200, 7], [11] * 6, [3])], params, use_tqdm=False)
    llm.generate([[4, 8]], params, use_tqdm=False)  # batch 1: its own decode paths
    with open(out, "w") as f:
        json.dump(list(launches.values()), f)
    print(f"recorded {len(launches)} distinct launches", flush=True)


def compile_all(path: str, arch: int) -> int:
    """Phase 2 (no interpreter): compile each recorded launch for ``arch``; returns the number of failures."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures, done = 0, set()
    for entry in json.load(open(path)):
        fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        for bf16 in (False, True):
            for pdl in (False, True):
                if pdl and "PDL" not in entry["args"]:
                    continue
                sig, consts = {}, {}
                for name, (kind, value) in entry["args"].items():
                    if kind == "constexpr":
                        sig[name] = "constexpr"
                        consts[name] = value
                    else:
                        sig[name] = ("*" if kind == "ptr" else "") + ("bf16" if bf16 and value == "fp32" and
                                                                      kind == "ptr" else value)
                if "USE_WHILE" in consts:  # the interpreter's loop form; the GPU runs the for loop
                    consts["USE_WHILE"] = False
                if bf16 and consts.get("PREC") == "ieee":
                    consts["PREC"] = "tf32"
                if pdl:  # as triton_utils.pdl_launch passes it
                    consts["PDL"] = True
                    if consts.get("PF_LINES") == 0:  # the L2 prefetch that PDL switches on (recorded without PDL)
                        consts["PF_LINES"] = 4
                opts = {k: v for k, v in entry["options"].items() if k != "launch_pdl"}
                opts["launch_pdl"] = pdl
                key = json.dumps([entry["module"], entry["kernel"], sig, consts, opts], sort_keys=True, default=str)
                if key in done:
                    continue
                done.add(key)
                label = f"{entry['kernel']}{' bf16' if bf16 else ''}{' pdl' if pdl else ''} {consts}"
                try:
                    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options=opts)
                except Exception as exc:  # report every failure, not just the first
                    failures += 1
                    print(f"FAILED {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
                else:
                    print(f"ok     {label[:150]}", flush=True)
    print(f"{len(done)} compiled for sm_{arch}, {failures} failed", flush=True)
    return failures


def main() -> int:
    from gpu_only import require

    require("tools/compile_check.py", cuda=False)
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--spec", default=None, choices=[None, "mtp", "ngram"])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--record-only", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record_only:
        record(args.checkpoint, args.spec, args.record_only)
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the recording step sets it for its own process")
    with tempfile.TemporaryDirectory() as tmp:
        rec = os.path.join(tmp, "launches.json")
        cmd = [sys.executable, __file__, "--record-only", rec]
        cmd += ["--checkpoint", args.checkpoint] if args.checkpoint else []
        cmd += ["--spec", args.spec] if args.spec else []
        subprocess.run(cmd, env=dict(os.environ, TRITON_INTERPRET="1", HYLO_TRITON_INTERPRET="1"), check=True)
        return 1 if compile_all(rec, args.arch) else 0


if __name__ == "__main__":
    sys.exit(main())
