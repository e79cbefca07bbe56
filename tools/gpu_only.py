"""For the tools that measure kernels on a GPU: ``require("tools/x.py", cuda=True, modules=("triton",))`` ends the
tool with one line saying what is missing (no CUDA device, or a module such as triton) instead of a traceback."""

from __future__ import annotations

import importlib.util
import sys


def require(tool: str, cuda: bool = True, modules: tuple[str, ...] = ("triton",)) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"error: {tool} needs {', '.join(missing)} (pip install -e '.[gpu]' on a machine with a CUDA GPU)")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"error: {tool} measures on a CUDA GPU, and torch sees none on this machine")
