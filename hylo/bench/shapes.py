"""The benchmark models: one shape per name, built with random weights on the GPU (``run.build_model``).

- ``bench-6b``: a Qwen3-Next-architecture MoE of 6.3 B parameters (24 layers, 64 experts), the shape the decode
  kernels were tuned on;
- ``qwen3-next-80b`` (also ``qwen3-next-80b-a3b``): Qwen3-Next-80B-A3B (160 GB in bfloat16: more than one GPU holds, for tensor parallelism);
- ``qwen3.5-9b``: Qwen3.5-9B (dense: a SwiGLU MLP in each of its 32 layers);
- ``qwen3.5-35b-a3b``: Qwen3.5-35B-A3B (40 layers, 256 experts, 8 routed and a shared one; 67 GiB in bfloat16);
- ``nemotron-h-8b``: a Nemotron-H of Nemotron-H-8B's sizes (hidden 4096; 52 blocks: 24 Mamba2 of 128 heads x 64
  channels with state 128 in 8 groups, 4 attention, 24 squared-ReLU MLPs of 21504; vocabulary 131072), the Mamba2
  backend's shape (no MTP head: n-gram's verify step for the speculative records);
- ``nemotron-3-nano-30b-a3b``: NVIDIA-Nemotron-3-Nano-30B-A3B's sizes (hidden 2688; 52 blocks: 23 Mamba2 of 64
  heads x 64 channels with state 128 in 8 groups, 6 attention with 2 key-value heads, 23 MoE blocks of 128
  squared-ReLU experts of 1856, 6 routed with scaling 2.5 and a shared one of 3712; vocabulary 131072; 63 GB in
  bfloat16), the non-gated expert kernels' shape;
- ``tiny``, ``tiny-dense``, ``tiny-mamba2``: for the harness's CPU tests (``tiny-mamba2`` with a Nemotron 3 MoE
  block);
- any of them with ``-fp8``: the same shape with its projections in block FP8 (128 x 128 blocks; 16 x 16 for the
  tiny shapes), kept FP8 in memory as an FP8 release is: ``qwen3-next-80b-fp8`` fits one H200.
The Qwen3.5 shapes are the released configs' text models (vocabulary 248320, RoPE theta 1e7 on a quarter of each
head), with their MTP head.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig, QuantConfig

BASE_MODELS = ("bench-6b", "qwen3-next-80b", "qwen3.5-9b", "qwen3.5-35b-a3b", "tiny", "tiny-dense")
MAMBA2_MODELS = ("nemotron-h-8b", "nemotron-3-nano-30b-a3b", "tiny-mamba2")  # no FP8 copies: quantized Mamba2 checkpoints are not served yet
BENCH_MODELS = BASE_MODELS + tuple(f"{m}-fp8" for m in BASE_MODELS) + MAMBA2_MODELS
# the release's own spelling (Qwen3-Next-80B-A3B) of the 80B shape, with or without -fp8
ALIASES = {"qwen3-next-80b-a3b": "qwen3-next-80b", "qwen3-next-80b-a3b-fp8": "qwen3-next-80b-fp8"}


# the shapes a CPU holds and runs in seconds
CPU_MODELS = ("tiny", "tiny-dense", "tiny-fp8", "tiny-dense-fp8", "tiny-mamba2")


def check_cpu_shape(model_name: str, device) -> None:
    """A benchmark on the CPU runs only the tiny shapes: a released one (bench-6b is 6 B parameters, float32 on
    the CPU) would fill the machine's memory for minutes before its first record."""
    if str(device) == "cpu" and canonical_name(model_name) not in CPU_MODELS:
        raise ValueError(f"benchmarking {model_name} needs a CUDA GPU; on the CPU only the tiny shapes run "
                         f"(--model-name {', '.join(CPU_MODELS)})")


def canonical_name(name: str) -> str:
    """The benchmark model's own name for ``name`` (an alias or the name itself)."""
    return ALIASES.get(name, name)


def _nemotron(pattern: str, **fields) -> ModelConfig:
    from ..models.nemotron_h import parse_config

    return parse_config(dict(model_type="nemotron_h", hybrid_override_pattern=pattern, conv_kernel=4,
                             max_position_embeddings=65536, eos_token_id=None, **fields))


def _hybrid(n_layers: int, **fields) -> ModelConfig:
    """A 3:1 GDN / attention hybrid with the fields every benchmark shape shares, then ``fields``."""
    base = dict(num_hidden_layers=n_layers,
                layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                  for i in range(n_layers)),
                num_key_value_heads=2, rope_theta=10000000.0, partial_rotary_factor=0.25, attention_bias=False,
                linear_conv_kernel_dim=4, intermediate_size=0, num_experts=0, num_experts_per_tok=0,
                moe_intermediate_size=0, shared_expert_intermediate_size=0, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=(), rms_norm_eps=1e-6, max_position_embeddings=65536,
                tie_word_embeddings=False, eos_token_ids=(), num_nextn_predict_layers=1)
    return ModelConfig(**{**base, **fields})


def bench_config(name: str) -> ModelConfig:
    name = canonical_name(name)
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown benchmark model {name!r} (known: {', '.join(BENCH_MODELS)})")
    if name.endswith("-fp8"):
        base = name.removesuffix("-fp8")
        block = (16, 16) if base.startswith("tiny") else (128, 128)
        return replace(bench_config(base), quantization=QuantConfig("fp8", block, keep=True))
    big_gdn = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                   linear_value_head_dim=128)
    tiny_gdn = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16)
    if name in ("bench-6b", "qwen3-next-80b"):
        return _hybrid(24 if name == "bench-6b" else 48, vocab_size=151936, hidden_size=2048, num_attention_heads=16,
                       head_dim=256, intermediate_size=5120, num_experts=64 if name == "bench-6b" else 512,
                       num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       **big_gdn)
    if name == "qwen3.5-9b":
        return _hybrid(32, vocab_size=248320, hidden_size=4096, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=256, intermediate_size=12288, model_type="qwen3_5", **big_gdn)
    if name == "qwen3.5-35b-a3b":
        return _hybrid(40, vocab_size=248320, hidden_size=2048, num_attention_heads=16, head_dim=256,
                       num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512, model_type="qwen3_5_moe", **big_gdn)
    if name == "nemotron-h-8b":
        pattern = "M-M-M-M*-" * 4 + "M-" * 8  # 24 Mamba2, 4 attention, 24 MLP blocks
        return _nemotron(pattern, vocab_size=131072, hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=21504, mamba_num_heads=128,
                         mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128)
    if name == "nemotron-3-nano-30b-a3b":  # the release's block pattern
        pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
        return _nemotron(pattern, vocab_size=131072, hidden_size=2688, num_attention_heads=32,
                         num_key_value_heads=2, head_dim=128, intermediate_size=1856, mamba_num_heads=64,
                         mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128, n_routed_experts=128,
                         num_experts_per_tok=6, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
                         n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    if name == "tiny-mamba2":
        return _nemotron("M*M-E", vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=96, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                         n_groups=2, chunk_size=32, n_routed_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=24, moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
                         routed_scaling_factor=2.5)
    if name == "tiny":
        return _hybrid(4, vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=128,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, **tiny_gdn)
    return _hybrid(4, vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=96,
                   tie_word_embeddings=True, model_type="qwen3_5", **tiny_gdn)
