"""hylo: an inference engine for hybrid linear-attention language models (Qwen3-Next first)."""

from .api import LLM
from .config import EngineConfig, ModelConfig
from .core import RequestOutput, SpecStats
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "SpecStats", "EngineConfig", "ModelConfig"]
__version__ = "0.1.0"
