"""Configuration: the model's shape (each family's parser in ``models/`` fills it from a Hugging Face
``config.json``, with the checks of ``models/hf_config.py``) and the engine's options.

Both are frozen dataclasses: nothing changes them after start-up, so every component can hold a reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight quantization (``config.json``'s ``quantization_config``), as hylo serves it: block
    FP8 (``method`` "fp8", float8_e4m3fn weights with one scale per ``block`` = [rows, cols] tile)."""

    method: str
    block: tuple[int, int]
    keep: bool = False  # the weights stay FP8 in memory (the GPU), else they are dequantized at load (the CPU)


@dataclass(frozen=True)
class Mamba2Spec:
    """A Mamba2 family's mixer shape and scalars (Nemotron-H, ...): ``num_heads`` heads of ``head_dim`` channels,
    ``n_groups`` groups of heads sharing B and C of ``state_size``, the conv's kernel and bias, the projections'
    biases, the gated norm's epsilon, the prefill's clamp of dt and its scan chunk."""

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    norm_eps: float
    dt_limit: tuple[float, float]
    chunk_size: int = 128
    # the output's gate and norm: "gate_then_norm" rms_norm(y * silu(z)) per group (Nemotron-H, Granite),
    # "norm_then_gate" rms_norm(y) * silu(z) (Falcon-H1 with mamba_rms_norm), "gate" y * silu(z) alone
    norm: str = "gate_then_norm"
    out_bias: bool | None = None  # out_proj's bias (None: as ``proj_bias``)

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C."""
        return self.inner + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class GroupedRouter:
    """Nemotron 3's MoE routing and experts: sigmoid scores plus a correction bias pick ``num_experts_per_tok``
    experts among the best ``topk_group`` of ``n_group`` groups (a group ranked by its two best biased scores); the
    chosen experts' unbiased scores, normalised where ``norm_topk_prob``, times ``routed_scaling_factor``, weight
    them. The experts are non-gated squared-ReLU MLPs on the hidden state, or on its ``latent_size`` projection."""

    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None


@dataclass(frozen=True)
class MuP:
    """A family's muP multipliers: the embeddings times ``embedding``, each block's output times ``residual`` before
    its residual add, attention scores times ``attention`` (in place of 1/sqrt(head_dim)), logits divided by
    ``logits`` (Granite-4.0-H); and Falcon-H1's, folded into the projections at load: the Mamba2 input projection's
    input times ``ssm_in`` and its [z, x, B, C, dt] rows times ``ssm_segments``, its output times ``ssm_out``; the
    attention's input times ``attention_in``, its keys times ``key``, its output times ``attention_out``; the MLP's
    gate pre-activation and output times ``mlp``."""

    embedding: float = 1.0
    residual: float = 1.0
    attention: float | None = None
    logits: float = 1.0
    ssm_in: float = 1.0
    ssm_segments: tuple[float, ...] = (1.0,) * 5
    ssm_out: float = 1.0
    attention_in: float = 1.0
    key: float = 1.0
    attention_out: float = 1.0
    mlp: tuple[float, float] = (1.0, 1.0)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a hybrid model (Qwen3-Next, Qwen3.5, ...), as its family's parser read it from ``config.json``
    (``models.registry.read_config``). ``model_type`` names the family in the registry."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    # "linear_attention" | "full_attention" per layer; Mamba2 families also "mlp" / "moe" (blocks with no cache) and
    # "hybrid" (attention and a linear mixer side by side)
    layer_types: tuple[str, ...]
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    attention_bias: bool
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # feed-forward
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    # misc
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 1
    # the MTP head's blocks in order where a family lists them (Nemotron-H's mtp_layers_block_type); else ()
    mtp_layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    model_type: str = "qwen3_next"
    quantization: QuantConfig | None = None  # None: the weights are stored in a float dtype
    mamba: Mamba2Spec | None = None  # the linear layers are Mamba2 mixers of this shape (else GDN)
    mup: MuP | None = None  # the family's multipliers, where it has them
    router: GroupedRouter | None = None  # Nemotron 3's grouped sigmoid routing and non-gated experts

    # ---- derived shapes -------------------------------------------------------------------------------------
    @property
    def attn_layer_ids(self) -> list[int]:
        """Layers with full attention ("hybrid" layers have both it and a linear mixer: Falcon-H1's)."""
        return [i for i, t in enumerate(self.layer_types) if t in ("full_attention", "hybrid")]

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in ("linear_attention", "hybrid")]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels that go through the causal conv: q, k and v of the GDN layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def state_dims(self) -> tuple[int, int, int, int, int]:
        """A linear layer's state in the pool: (conv channels, conv kernel, heads, and the recurrent state's two
        dims per head): GDN's [Hv, Dk, Dv], Mamba2's [H, P, N]."""
        m = self.mamba
        if m is not None:
            return m.conv_dim, m.conv_kernel, m.num_heads, m.head_dim, m.state_size
        return (self.conv_dim, self.linear_conv_kernel_dim, self.linear_num_value_heads, self.linear_key_head_dim,
                self.linear_value_head_dim)

    @property
    def decode_matches_prefill(self) -> bool:
        """Whether a token's state update is the same computed by a decode step as by a prefill. Not for Mamba2
        layers whose prefill clamps dt (the reference's decode step does not): a state that decoding produced is
        then not the one a prefill of the same tokens (the next turn's prompt, computed afresh) gives."""
        return self.mamba is None or tuple(self.mamba.dt_limit) == (0.0, float("inf"))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    def validate(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.attn_layer_ids and self.rotary_dim % 2:  # (a model without attention has no rotary)
            problems.append("head_dim * partial_rotary_factor must be even")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            problems.append("num_experts_per_tok must be in [1, num_experts]")
        r = self.router
        if r is not None and (r.n_group < 1 or self.num_experts % r.n_group or not 1 <= r.topk_group <= r.n_group
                              or self.num_experts // r.n_group < 2
                              or self.num_experts_per_tok > r.topk_group * (self.num_experts // r.n_group)):
            problems.append(f"the router's groups do not fit its experts (n_routed_experts {self.num_experts}, "
                            f"n_group {r.n_group}, topk_group {r.topk_group}, num_experts_per_tok "
                            f"{self.num_experts_per_tok}: groups of two experts or more, enough of them chosen)")
        if self.mamba is not None and self.mamba.num_heads % self.mamba.n_groups:
            problems.append(f"the Mamba2 heads ({self.mamba.num_heads}) must be a multiple of n_groups "
                            f"({self.mamba.n_groups})")
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad_eos:
            problems.append(f"eos_token_id {bad_eos[0]} is outside the vocabulary (ids are 0..{self.vocab_size - 1})")
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            problems.append(f"mlp_only_layers names layer {bad_layers[0]}, past the {self.num_hidden_layers} layers")
        acts = ("silu", "relu2") if self.mamba is not None else ("silu",)  # the MLPs hylo has
        if self.hidden_act not in acts:
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (only {' or '.join(acts)})")
        if problems:
            raise ValueError(f"invalid {self.model_type} config: " + "; ".join(problems))

    def to_hf_dict(self) -> dict[str, Any]:
        """The Qwen3-Next ``config.json`` that describes this model (used to write checkpoints)."""
        if self.model_type != "qwen3_next":
            raise ValueError(f"to_hf_dict writes Qwen3-Next configs, not {self.model_type!r}")
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "attention_bias": self.attention_bias,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": list(self.eos_token_ids) or None,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "hidden_act": self.hidden_act,
        }


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance. Every field can be passed to ``LLM(...)`` and most to the CLI."""

    max_num_seqs: int = 64  # concurrent requests (request slots; slot 0 is reserved for padding)
    max_model_len: int | None = None  # context limit per request; default: min(config, KV pool)
    chunk_size: int = 2048  # prefill tokens per step (chunked prefill budget)
    kv_cache_tokens: int | None = None  # explicit KV pool size in tokens; default: from the memory budget
    memory_budget_gb: float | None = None  # cache memory budget; default: CPU 2 GiB, CUDA 90% of free memory
    state_dtype: str = "float32"  # recurrent state dtype of the linear-attention layers
    seed: int = 0  # seed of the engine's own random draws (per-request seeds for unseeded requests)
    preemption: str = "recompute"  # when KV runs out mid-decode: preempt the newest request and re-run it
    speculative: str | None = None  # None, "mtp" (the checkpoint's MTP head) or "ngram" (prompt lookup)
    num_speculative_tokens: int = 3  # k drafts per verify step
    # "adaptive": verify only where the rows' acceptance pays for it, else decode plainly and probe now and then
    # (engine/spec_policy.py); "fixed": verify k drafts at every step
    spec_policy: str = "adaptive"
    # how a verify step's accepted GDN state reaches the request's slot: "replay" (the verify keeps each step's
    # inputs, the commit re-runs the accepted steps from the slot: about a third of the state traffic and a
    # fraction of the memory) or "checkpoints" (the verify writes the state after every step, the commit copies one)
    spec_commit: str = "replay"
    # Benchmarks on random weights only: force this mean accept length (tokens per verify step). NOT lossless.
    simulate_accept_length: float | None = None
    verbose: bool = True  # print the memory plan at start-up
    # launch step N+1 before reading step N's results (no host-device sync in the steady state); off: read each
    # step's results before launching the next (for comparison and debugging)
    overlap: bool = True
    tensor_parallel_size: int = 1  # processes (one GPU each on CUDA) the model is sharded across
    cuda_graphs: bool = True  # on CUDA: capture decode / verify / draft passes (off: everything eager)
    max_graph_batch_size: int = 256  # largest captured batch size (larger batches run eagerly)
    cuda_graph_sizes: tuple[int, ...] | None = None  # explicit captured batch sizes (default: 1, 2, 4, 8, 16, ...)
    # prefix caching (cache/prefix_cache.py): reuse cached KV and linear-attention state snapshots of earlier
    # requests' tokens; snapshots where requests stop, at prompt ends and every prefix_state_interval prefill
    # tokens (default: chunk_size); prefix_snapshots state slots for them (default: from the memory budget)
    enable_prefix_caching: bool = True
    prefix_state_interval: int | None = None
    prefix_snapshots: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "chunk_size", "max_model_len", "kv_cache_tokens", "prefix_state_interval",
                     "prefix_snapshots", "max_graph_batch_size"):
            value = getattr(self, name, None)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("verbose", "overlap", "cuda_graphs", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):  # "no" would read as true
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2:
            raise ValueError(f"kv_cache_tokens must be >= 2, got {self.kv_cache_tokens}")
        budget = self.memory_budget_gb
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not (budget > 0 and math.isfinite(budget))):
            raise ValueError(f"memory_budget_gb must be a positive number, got {budget!r}")
        if self.state_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"state_dtype must be float32, bfloat16 or float16, got {self.state_dtype!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.spec_commit not in ("replay", "checkpoints"):
            raise ValueError(f"spec_commit must be 'replay' or 'checkpoints', got {self.spec_commit!r}")
        if self.spec_policy not in ("adaptive", "fixed"):
            raise ValueError(f"spec_policy must be 'adaptive' or 'fixed', got {self.spec_policy!r}")
        if self.speculative not in (None, "mtp", "ngram"):
            raise ValueError(f"speculative must be None, 'mtp' or 'ngram', got {self.speculative!r}")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int) \
                or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        sal = self.simulate_accept_length
        if sal is not None and (isinstance(sal, bool) or not isinstance(sal, (int, float)) or not math.isfinite(sal)):
            raise ValueError(f"simulate_accept_length must be a number, got {sal!r}")
        sizes = self.cuda_graph_sizes
        if sizes is not None and (isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__") or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes)):
            raise ValueError(f"cuda_graph_sizes must be batch sizes (integers >= 1), got {sizes!r}")
        if sizes and min(sizes) > self.max_num_seqs:  # (sizes past max_num_seqs are never captured)
            raise ValueError(f"cuda_graph_sizes {tuple(sizes)} has no size within max_num_seqs={self.max_num_seqs}: "
                             "no batch could replay a graph")
        if self.simulate_accept_length is not None:
            if self.speculative is None:
                raise ValueError("simulate_accept_length needs speculative decoding (speculative='mtp' or 'ngram')")
            if not (1.0 <= self.simulate_accept_length <= self.num_speculative_tokens + 1):
                raise ValueError(f"simulate_accept_length must be in [1, num_speculative_tokens + 1 = "
                                 f"{self.num_speculative_tokens + 1}], got {self.simulate_accept_length}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.prefix_state_interval is not None and self.prefix_state_interval < 1:
            raise ValueError(f"prefix_state_interval must be >= 1, got {self.prefix_state_interval}")
        if self.prefix_snapshots is not None and self.prefix_snapshots < 0:
            raise ValueError(f"prefix_snapshots must be >= 0, got {self.prefix_snapshots}")
        if self.preemption != "recompute":
            raise ValueError(f"preemption must be 'recompute', got {self.preemption!r}")

    @property
    def spec_tokens(self) -> int:
        """k when speculative decoding is on, else 0."""
        return self.num_speculative_tokens if self.speculative else 0

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


__all__ = ["ModelConfig", "EngineConfig"]
