"""hylo: an inference engine for hybrid linear-attention language models (Qwen3-Next first)."""

import importlib

__all__ = ["LLM", "SamplingParams", "RequestOutput", "SpecStats", "EngineConfig", "ModelConfig"]
__version__ = "0.1.0"

# The public names load on first use (PEP 562): ``import hylo.cli`` then imports no kernel module, so the command
# line reports a malformed HYLO_* setting (read when the kernels' modules load) as its one-line error.
_HOME = {"LLM": ".api", "SamplingParams": ".sampling_params", "RequestOutput": ".core", "SpecStats": ".core",
         "EngineConfig": ".config", "ModelConfig": ".config"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'hylo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
