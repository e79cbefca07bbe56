"""The HF transformers side of ``hylo bench --vs-hf``: the same weights in transformers' Qwen3-Next, and its
``generate`` timed per decode step."""

from __future__ import annotations

import math
import time

import torch

from ..config import ModelConfig
from ..layers.weights import TensorReader


class HFReader(TensorReader):
    """An HF transformers model's weights under their on-disk names (fused experts split per expert); names the
    HF model lacks (the MTP head) come from a RandomReader."""

    def __init__(self, hf_model, fallback: TensorReader):
        super().__init__()
        self.sd = dict(hf_model.state_dict())
        self.fallback = fallback

    def keys(self):
        return self.used

    def has(self, name):
        return name in self.sd or name.startswith("mtp.") or ".experts." in name

    def get(self, name, shape=None):
        self.used.add(name)
        if name in self.sd:  # fused experts included
            return self.sd[name]
        if name.startswith("mtp."):
            return self.fallback.get(name, shape)
        if ".experts." in name:
            prefix, rest = name.split(".experts.")
            e, proj = rest.split(".")[0], rest.split(".")[1]
            e = int(e)
            if proj == "down_proj":
                return self.sd[f"{prefix}.experts.down_proj"][e]
            gate_up = self.sd[f"{prefix}.experts.gate_up_proj"][e]
            half = gate_up.shape[0] // 2
            return gate_up[:half] if proj == "gate_proj" else gate_up[half:]
        return self.sd[name]


def hf_config(mc: ModelConfig):
    from transformers import Qwen3NextConfig

    d = mc.to_hf_dict()
    d.pop("architectures"), d.pop("model_type"), d.pop("num_nextn_predict_layers")
    return Qwen3NextConfig(**d)


def build_hf(mc: ModelConfig, device):
    from transformers import Qwen3NextForCausalLM as HF

    cfg = hf_config(mc)
    with torch.device(device):
        model = HF._from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def time_hf(model, mc: ModelConfig, batches: list[int], quick: bool) -> dict[int, float]:
    """HF generate's ms per decode step: (time of 1 + n new tokens - time of 1) / n, best of a few (it is noisy)."""
    out = {}
    n = 8 if quick else 16
    for bs in batches:
        ids = torch.randint(0, mc.vocab_size, (bs, 32), device=model.device)
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

        def gen(new):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        gen(2)
        best = math.inf
        for _ in range(2 if quick else 3):
            best = min(best, (gen(1 + n) - gen(1)) * 1e3 / n)
        out[bs] = best
        print(f"[bench] HF transformers generate bs={bs}: {best:.1f} ms/step", flush=True)
    return out
