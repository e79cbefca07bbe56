"""Test helpers: tiny Qwen3-Next checkpoints written by transformers' own ``save_pretrained``, HF references."""

from __future__ import annotations

import json
import os
import random

import torch

from hylo import SamplingParams

# Two shapes that differ in everything the loader and the layers must get right: layer pattern, key/value head
# ratios, head sizes that are not powers of two, partial rotary factor, dense layers among MoE layers, biases,
# tied embeddings, conv kernel size, top-k normalisation, a shared expert of the routed size (folded in as one
# more expert) and one of another size.
CONFIGS = {
    "a": dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=20, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
              initializer_range=0.05),
    "b": dict(vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=5, num_attention_heads=6,
              num_key_value_heads=3, head_dim=20, linear_conv_kernel_dim=3, linear_key_head_dim=12,
              linear_value_head_dim=10, linear_num_key_heads=1, linear_num_value_heads=3, moe_intermediate_size=24,
              shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=3, norm_topk_prob=False,
              decoder_sparse_step=2, attention_bias=True, tie_word_embeddings=True,
              layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                           "linear_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
              initializer_range=0.05),
}


def _perturb_norms(model):
    """transformers initialises norms to exactly 1 (or 0, zero-centred) and A_log/dt_bias to fixed values; give
    them random values so that a wrong formula cannot hide behind a neutral weight."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            if "bias" in name and "dt_bias" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def make_hf_checkpoint(path: str, name: str, **save_kwargs) -> str:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**CONFIGS[name])
    model = Qwen3NextForCausalLM(cfg).eval()
    _perturb_norms(model)
    model.save_pretrained(path, **save_kwargs)
    return path


def load_hf(path: str):
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def vocab_of(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)["vocab_size"]  # Qwen3.5's released form nests the text config


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF transformers greedy continuation: a cached prefill, then single-token cached decode steps.

    NOTE: written as an explicit loop over the model's forward rather than ``generate``: on these checkpoints
    transformers 5.24's ``generate`` drifts from its own cached and uncached forwards (seen: a 0.012 logit
    difference after 93 tokens), while this loop agrees with the uncached full-sequence forward to 1e-6.
    """
    out_tokens = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_tokens.append(tok)
            if len(out_tokens) == n:
                break
            out = hf(torch.tensor([[tok]]), cache=out.cache, use_cache=True)
    return out_tokens


def assert_logits_match(eng, hf, prompts, tol: float = 1e-4) -> None:
    """The engine's prompt logits (chunked prefill through its caches) equal the transformers model's own forward
    over each whole prompt, within ``tol``."""
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        ours = eng.prompt_logits(prompt)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < tol


def spec_engine(path, spec=None, **opts):
    """An engine on ``path`` with chunk size 16, plain or speculative (k = 3), quiet; ``opts`` go to EngineConfig."""
    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine
    from hylo.speculative.setup import SpecSetup

    opts.setdefault("chunk_size", 16)
    ec = EngineConfig(verbose=False, **({"speculative": spec, "num_speculative_tokens": 3} if spec else {}), **opts)
    return Engine(path, engine_config=ec, spec_setup=SpecSetup(spec) if spec else None)


def run_all(eng, prompts, params):
    """Add the prompts, step until everything ended, return the outputs in order."""
    rids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [eng.pop_finished(r) for r in rids]


def all_freed(engine) -> bool:
    """Everything ended: no request holds a cached prefix, and once the prefix cache is dropped every slot and KV
    location is back in its pool."""
    cache = engine.prefix_cache
    if cache is not None and any(n.lock for n in cache._nodes()):
        return False
    if not engine.reset_prefix_cache():
        return False
    c = engine.caches
    return (c.req_slots.num_free == c.req_slots.max_num_seqs and c.state_pool.num_free == c.state_pool.num_slots
            and c.kv_pool.num_free == c.kv_pool.num_tokens and (cache is None or cache.num_snapshots == 0))


def write_snapshot_count(engine, folder: str) -> None:
    """For ``LeaderEngine.run_on_all``: each rank writes its prefix cache's snapshot count to ``folder/<pid>``."""
    import os

    with open(os.path.join(folder, str(os.getpid())), "w") as f:
        f.write(str(engine.prefix_cache.num_snapshots))


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def append_mtp(src: str, dst: str, seed: int = 0) -> str:
    """Copy a checkpoint and append random ``mtp.*`` tensors (transformers does not write them)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hylo.models.registry import read_config
    from hylo.models.random_init import random_mtp_tensors

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    tensors.update(random_mtp_tensors(read_config(dst), seed=seed, std=0.05))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---- traffic: requests arriving, finishing and being aborted at given steps ------------------------------------
def traffic(vocab, n, seed, max_steps_between=3, abort_frac=0.2, max_tokens=(1, 24), shared=0):
    """n requests: prompt, params, arrival step, and an abort step (or None). With ``shared``, about half the
    prompts start with one of ``shared`` common prefixes, or with an earlier prompt (prefix-cache hits)."""
    rng = random.Random(seed)
    prompts = random_prompts(vocab, [rng.randint(1, 40) for _ in range(n)], seed=seed)
    if shared:
        prefixes = random_prompts(vocab, [rng.randint(10, 30) for _ in range(shared)], seed=seed + 1)
        for i in range(n):
            r = rng.random()
            if r < 0.3:
                prompts[i] = prefixes[rng.randrange(shared)] + prompts[i]
            elif r < 0.5 and i:
                base = prompts[rng.randrange(i)]
                if len(base) < 60:
                    prompts[i] = base + prompts[i][:rng.randint(1, 8)]
    step, reqs = 0, []
    for i, p in enumerate(prompts):
        step += rng.randint(0, max_steps_between)
        params = SamplingParams(max_tokens=rng.randint(*max_tokens), temperature=0,
                                stop_token_ids=[rng.randrange(vocab)] if rng.random() < 0.3 else None)
        abort = step + rng.randint(0, 12) if rng.random() < abort_frac else None
        reqs.append((p, params, step, abort))
    return reqs


def drive(eng, workload, on_step=None):
    """Run a workload (arrivals and aborts keyed by step number); returns every request's output."""
    arrivals, aborts = {}, {}
    for i, (_, _, at, ab) in enumerate(workload):
        arrivals.setdefault(at, []).append(i)
        if ab is not None:
            aborts.setdefault(ab, []).append(i)
    last = max([at for _, _, at, _ in workload] + [ab for *_, ab in workload if ab is not None])
    rids, step = {}, 0
    while step <= last or eng.has_unfinished():
        for i in arrivals.get(step, []):
            p, params, _, _ = workload[i]
            rids[i] = eng.add_request(p, params, request_id=f"r{i}")
        for i in aborts.get(step, []):
            eng.abort(rids[i])
        eng.step()
        if on_step is not None:
            on_step(step)
        step += 1
    return {i: eng.pop_finished(rid) for i, rid in rids.items()}, step


def check_against(outs, ref, workload):
    """Requests that were not aborted match the reference exactly; aborted ones produced a prefix of it."""
    aborted = 0
    for i, (_, _, _, ab) in enumerate(workload):
        o, r = outs[i], ref[i]
        if o.finish_reason == "abort":
            aborted += 1
            assert o.token_ids == r.token_ids[:len(o.token_ids)], i
        else:
            assert (o.token_ids, o.finish_reason) == (r.token_ids, r.finish_reason), i
    return aborted


# ---- Qwen3.5 ---------------------------------------------------------------------------------------------------
# Released Qwen3.5 checkpoints come as Qwen3_5ForConditionalGeneration (text under model.language_model.*, a vision
# tower under model.visual.*); transformers also writes Qwen3_5ForCausalLM (text only, model.*). Shapes unlike the
# Qwen3-Next ones and unlike the releases: odd head counts and sizes, a value/key head ratio of 3, a conv kernel of
# 3, interleaved and plain mrope sections, tied embeddings, a folded and an unfolded shared expert.
QWEN35_TEXT = {
    "dense": dict(vocab_size=130, hidden_size=48, intermediate_size=80, num_hidden_layers=5, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=24, linear_conv_kernel_dim=3, linear_key_head_dim=12,
                  linear_value_head_dim=10, linear_num_key_heads=2, linear_num_value_heads=6,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                               "full_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [2, 2, 2], "mrope_interleaved": True},
                  initializer_range=0.05),
    "moe": dict(vocab_size=150, hidden_size=40, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
                linear_num_key_heads=1, linear_num_value_heads=2, num_experts=6, num_experts_per_tok=3,
                moe_intermediate_size=20, shared_expert_intermediate_size=20,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": False},
                initializer_range=0.05),
}
# the Qwen3.5 checkpoint fixtures (conftest.py): name -> (fixture, kind, form)
Q35 = {"dense-vl": ("q35_dense_vl", "dense", "vl"), "dense-text": ("q35_dense_text", "dense", "text"),
       "moe-vl": ("q35_moe_vl", "moe", "vl"), "moe-text": ("q35_moe_text", "moe", "text")}
QWEN35_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48, patch_size=4,
                     temporal_patch_size=2, num_position_embeddings=16)


def qwen35_classes(kind: str, form: str):
    """(config class, model class) of transformers for a Qwen3.5 kind ("dense"/"moe") and form ("vl"/"text")."""
    import transformers as T

    name = {"dense": "Qwen3_5", "moe": "Qwen3_5Moe"}[kind]
    if form == "vl":
        return getattr(T, f"{name}Config"), getattr(T, f"{name}ForConditionalGeneration")
    return getattr(T, f"{name}TextConfig"), getattr(T, f"{name}ForCausalLM")


def make_qwen35_checkpoint(path: str, kind: str, form: str, **overrides) -> str:
    """A Qwen3.5 checkpoint written by transformers (``form`` "vl": the released layout with a small vision tower;
    "text": Qwen3_5ForCausalLM), with random mtp.* tensors appended under the releases' names (the MoE kind's MTP
    experts fused, as the MoE releases store them)."""
    from safetensors.torch import load_file, save_file

    from hylo.models.random_init import random_mtp_tensors
    from hylo.models.registry import read_config

    torch.manual_seed(0)
    text = {**QWEN35_TEXT[kind], **overrides}
    cfg_cls, model_cls = qwen35_classes(kind, form)
    if form == "vl":
        if kind == "dense":  # the small dense releases tie their embeddings at the outer level
            cfg = cfg_cls(text_config={**text, "tie_word_embeddings": True}, vision_config=QWEN35_VISION,
                          tie_word_embeddings=True)
        else:
            cfg = cfg_cls(text_config=text, vision_config=QWEN35_VISION)
    else:
        cfg = cfg_cls(**text)
    model = model_cls(cfg).eval()
    _perturb_norms(model)
    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    mtp = random_mtp_tensors(read_config(path), seed=3, std=0.05)
    if kind == "moe":
        mtp = fuse_experts(mtp)
    tensors.update(mtp)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def fuse_experts(tensors: dict) -> dict:
    """Per-expert tensors (``experts.E.{gate,up,down}_proj.weight``) replaced by the fused form some releases ship:
    ``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``experts.down_proj`` [E, H, I]."""
    import re

    out, groups = {}, {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]])
                                                     for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    return out


def load_hf_qwen35(path: str, kind: str, form: str):
    return qwen35_classes(kind, form)[1].from_pretrained(path, dtype=torch.float32).eval()


def _save_randomized(model, path: str):
    """Weights large enough that every block matters (matrices N(0, 0.15), norms 1 + N(0, 0.2)), written by
    ``save_pretrained``; returns (path, model)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path, model


def make_nemotron_h_checkpoint(path: str, **overrides):
    """A tiny Nemotron-H (Mamba2, attention and MLP blocks; 3 groups, head dim 6, state 5: not powers of two)
    written by transformers' ``save_pretrained``; returns (path, the transformers model)."""
    import transformers

    cfg = dict(hybrid_override_pattern="M*M-M-*M", vocab_size=97, hidden_size=32, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, mamba_num_heads=6, mamba_head_dim=6, ssm_state_size=5, n_groups=3,
               conv_kernel=4, chunk_size=8, intermediate_size=40, use_conv_bias=True, num_nextn_predict_layers=0,
               eos_token_id=None, tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg)).eval()
    return _save_randomized(model, path)


def make_nemotron3_checkpoint(path: str, **overrides):
    """A tiny Nemotron 3 (Nemotron-H with MoE blocks: 8 non-gated squared-ReLU experts in 4 groups, 3 chosen among
    the best 2 groups, routed scaling 2.5, a latent projection of 16, a shared expert; a random score-correction
    bias) written by transformers' ``save_pretrained``; returns (path, the transformers model)."""
    import transformers

    cfg = dict(hybrid_override_pattern="ME*EM-E", vocab_size=97, hidden_size=32, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, mamba_num_heads=6, mamba_head_dim=6, ssm_state_size=5, n_groups=3,
               conv_kernel=4, chunk_size=8, intermediate_size=40, use_conv_bias=True, n_routed_experts=8,
               num_experts_per_tok=3, moe_intermediate_size=12, moe_shared_expert_intermediate_size=20, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, moe_latent_size=16, num_nextn_predict_layers=0,
               eos_token_id=None, tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(3)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg)).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    return _save_randomized(model, path)


def make_nemotron3_mtp_checkpoint(path: str):
    """A tiny Nemotron 3 with MTP layers as Nemotron 3 Super ships them (``mtp.layers.0``: the attention block with
    enorm / hnorm / eh_proj; ``mtp.layers.1``: the MoE block with final_layernorm), no latent projection and a
    shared expert twice the experts' width (folded). transformers writes no ``mtp.*``: the blocks come from a second
    transformers model whose blocks are those two, saved under its own names and renamed. Returns (path, the
    target's transformers model, the blocks' transformers model, the fusion weights {enorm, hnorm, eh_proj})."""
    import transformers
    from safetensors.torch import load_file, save_file

    pattern = dict(num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"], moe_latent_size=None,
                   moe_shared_expert_intermediate_size=24)
    path, hf = make_nemotron3_checkpoint(path, **pattern)
    cfg = hf.config.to_dict()
    cfg.update(layers_block_type=["attention", "moe"], num_hidden_layers=2, num_nextn_predict_layers=0)
    for key in ("hybrid_override_pattern", "architectures", "model_type", "transformers_version"):
        cfg.pop(key, None)
    torch.manual_seed(11)
    blocks = transformers.NemotronHModel(transformers.NemotronHConfig(**cfg)).eval()
    H = hf.config.hidden_size
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in blocks.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15, generator=g)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "bias" in name:
                p.normal_(0, 0.1, generator=g)
        fusion = dict(enorm=1 + 0.2 * torch.randn(H, generator=g), hnorm=1 + 0.2 * torch.randn(H, generator=g),
                      eh_proj=torch.randn(H, 2 * H, generator=g) * 0.15)
    blocks_path = path + "-blocks"
    blocks.save_pretrained(blocks_path)  # the names transformers writes (experts one by one)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name, t in load_file(os.path.join(blocks_path, "model.safetensors")).items():
        name = name.removeprefix("backbone.").removeprefix("model.")
        if name.startswith("layers."):
            tensors["mtp." + name] = t
        elif name == "norm_f.weight":
            tensors["mtp.layers.1.final_layernorm.weight"] = t
    for key, t in fusion.items():
        tensors[f"mtp.layers.0.{key}.weight"] = t
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path, hf, blocks, fusion


def make_granite_hybrid_checkpoint(path: str, **overrides):
    """A tiny Granite-4.0-H (Mamba2 and RoPE attention layers, each followed by a MoE plus a shared MLP; muP
    multipliers away from 1) written by transformers' ``save_pretrained``; returns (path, the transformers model)."""
    import transformers

    cfg = dict(num_hidden_layers=5, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                                  "full_attention"],
               vocab_size=89, hidden_size=24, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=6,
               mamba_d_head=8, mamba_d_state=5, mamba_n_groups=3, mamba_expand=2, mamba_chunk_size=8,
               intermediate_size=12, shared_intermediate_size=20, num_local_experts=5, num_experts_per_tok=2,
               position_embedding_type="rope", embedding_multiplier=1.7, residual_multiplier=0.6,
               attention_multiplier=0.3, logits_scaling=2.5, eos_token_id=None, tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(1)
    model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**cfg)).eval()
    return _save_randomized(model, path)


def make_falcon_h1_checkpoint(path: str, **overrides):
    """A tiny Falcon-H1 (Mamba2 and RoPE attention side by side in every layer, every muP multiplier away from 1)
    written by transformers' ``save_pretrained``; returns (path, the transformers model)."""
    import transformers

    cfg = dict(num_hidden_layers=3, vocab_size=83, hidden_size=24, intermediate_size=28, num_attention_heads=4,
               num_key_value_heads=2, mamba_d_ssm=30, mamba_n_heads=6, mamba_d_state=5, mamba_n_groups=3,
               mamba_chunk_size=8, embedding_multiplier=1.3, lm_head_multiplier=0.7, ssm_in_multiplier=1.2,
               ssm_out_multiplier=0.8, ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7], attention_in_multiplier=0.9,
               key_multiplier=1.4, attention_out_multiplier=0.6, mlp_multipliers=[1.3, 0.7], eos_token_id=None,
               tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(2)
    model = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**cfg)).eval()
    return _save_randomized(model, path)


def cycle_steps(eng, pattern=("plain", "draft", "verify", "verify", "verify")):
    """Make a speculative engine's policy deterministic: its decoding steps cycle through plain decoding without
    drafts, plain decoding that drafts at its end, and verifying (when every row has drafts), so that every kind of
    step runs and two engines given the same work make the same choices (the adaptive policy's follow measured
    step times)."""
    from hylo.engine.spec_policy import StepChoice

    calls = iter(range(10 ** 9))

    def choose(reqs):
        kind = pattern[next(calls) % len(pattern)]
        verify = kind == "verify" and all(r.has_drafts for r in reqs)
        return StepChoice(verify, kind != "plain")
    if eng.scheduler.policy is not None:
        eng.scheduler.policy.choose = choose
    return eng
