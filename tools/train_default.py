"""Train hylo's embedded default model: a small Qwen3-Next-architecture model with an MTP head, on the Python
standard library's own source (its tests excluded), with a byte-level BPE tokenizer trained on the same corpus.

Runs on a GPU (HF transformers' Qwen3-Next implementation does the forward and backward; the MTP head is built from
HF's own decoder layer and trained on the next-next token, as DeepSeek-V3 / Qwen3-Next train theirs). Writes a
plain Hugging Face checkpoint directory: ``config.json``, ``model.safetensors`` (bfloat16, per-expert names,
``mtp.*`` appended), ``tokenizer.json``, ``generation_config.json``, ``training.json`` (corpus, tokenizer, sizes,
steps, losses) and ``heldout_sample.txt`` (held-out text whose loss is recorded, for the tests).

    python tools/train_default.py --out hylo/models/default_ckpt            # on the H200: about 6 minutes
    python tools/train_default.py --out /tmp/t --steps 3 --tiny --device cpu  # smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SEED = 0


# ---- corpus ------------------------------------------------------------------------------------------------------
def stdlib_files() -> list[str]:
    """Every .py file of the standard library, tests excluded (test packages, test_*.py, idle's tests)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        parts = set(rel.split(os.sep))
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        if parts & {"test", "tests", "idle_test", "unittest/test"} or "site-packages" in rel:
            continue
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith("test_") and f != "conftest.py":
                out.append(os.path.join(d, f))
    return sorted(out)


def split_files(files: list[str], root: str, heldout_frac: float = 0.02):
    """A fixed split by a hash of the relative path (independent of file order and machine)."""
    train, held = [], []
    for f in files:
        h = int(hashlib.sha256(os.path.relpath(f, root).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (held if h < heldout_frac else train).append(f)
    return train, held


def read(f: str) -> str:
    with open(f, encoding="utf-8", errors="replace") as fh:
        return fh.read()


# ---- tokenizer ----------------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# ---- model -------------------------------------------------------------------------------------------------------
def make_config(vocab_size: int, tiny: bool):
    from transformers import Qwen3NextConfig

    h = 64 if tiny else 256
    cfg = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=4 if tiny else 8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=h // 4, linear_value_head_dim=h // 4, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=h * 3 // 8, shared_expert_intermediate_size=h * 3 // 8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=True,
        max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.02, router_aux_loss_coef=0.01,
        bos_token_id=None, eos_token_id=0, pad_token_id=None,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (1 if tiny else 2))
    cfg.num_nextn_predict_layers = 1
    return cfg


class MTPHead(torch.nn.Module):
    """Qwen3-Next's MTP head from HF parts: fc(cat(norm_e(embed(t+1)), norm_h(h_t))) -> attention decoder layer ->
    norm; its logits (through the shared lm_head) predict token t+2."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.qwen3_next import modeling_qwen3_next as M

        H = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = M.Qwen3NextRMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = M.Qwen3NextRMSNorm(H, cfg.rms_norm_eps)
        self.layer = M.Qwen3NextDecoderLayer(cfg, cfg.layer_types.index("full_attention"))
        self.norm = M.Qwen3NextRMSNorm(H, cfg.rms_norm_eps)
        self.rotary = M.Qwen3NextRotaryEmbedding(cfg)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], -1))
        L = x.shape[1]
        pos = torch.arange(L, device=x.device)[None]
        mask = torch.full((L, L), float("-inf"), device=x.device).triu(1)[None, None].to(x.dtype)
        out = self.layer(x, position_embeddings=self.rotary(x, pos), attention_mask=mask, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The head under Qwen3-Next's on-disk names (``mtp.*``, per-expert keys)."""
        out = {"mtp.fc.weight": self.fc.weight,
               "mtp.pre_fc_norm_embedding.weight": self.pre_fc_norm_embedding.weight,
               "mtp.pre_fc_norm_hidden.weight": self.pre_fc_norm_hidden.weight, "mtp.norm.weight": self.norm.weight}
        for name, t in self.layer.state_dict().items():
            if name == "mlp.experts.gate_up_proj":  # [E, 2I, H] fused in memory, per expert on disk
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                    out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
            elif name == "mlp.experts.down_proj":
                for e in range(t.shape[0]):
                    out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                out[f"mtp.layers.0.{name}"] = t
        return {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in out.items()}


def use_fla_chunk(model, dev) -> str:
    """On CUDA with fla-core importable, give HF's GDN layers fla's chunked kernel (forward and backward) instead
    of HF's PyTorch fallback, after checking on a small input that both agree. Returns which one is used."""
    if dev.type != "cuda":
        return "torch (HF fallback)"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from transformers.models.qwen3_next import modeling_qwen3_next as M

        reference = M.torch_chunk_gated_delta_rule

        def fla_wrap(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                     cu_seqlens=None, **_):
            return fla_chunk(q, k, v, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens)

        g = torch.Generator(device=dev).manual_seed(1)
        q, k, v = (torch.randn(2, 96, 4, 32, device=dev, generator=g).requires_grad_() for _ in range(3))
        gate = -torch.rand(2, 96, 4, device=dev, generator=g)
        beta = torch.rand(2, 96, 4, device=dev, generator=g)
        a, _ = fla_wrap(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
        b, _ = reference(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
        a.sum().backward()  # fla refuses some backward passes on some Triton versions: find out now
        if not torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2):
            print(f"fla chunk disagrees with HF's fallback ({(a - b).abs().max().item():.3g}): not used", flush=True)
            return "torch (HF fallback)"
    except Exception as e:  # noqa: BLE001 - the fallback is correct, only slower
        print(f"fla chunk not used: {e}", flush=True)
        return "torch (HF fallback)"
    M.torch_chunk_gated_delta_rule = fla_wrap  # transformers >= 5.2x calls the module-level function
    for layer in model.model.layers:  # older versions keep it on the layer
        if hasattr(layer, "linear_attn") and hasattr(layer.linear_attn, "chunk_gated_delta_rule"):
            layer.linear_attn.chunk_gated_delta_rule = fla_wrap
    return "fla-core chunk_gated_delta_rule"


def losses(model, mtp, ids: torch.Tensor, aux_coef: float):
    """(next-token loss, next-next-token loss of the MTP head, router balance loss)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as M

    out = model.model(input_ids=ids, output_router_logits=True)
    h = out.last_hidden_state  # after the final norm
    logits = model.lm_head(h[:, :-1])
    main = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    emb = model.model.embed_tokens(ids[:, 1:])
    m = mtp(emb[:, :-1], h[:, :-2])  # pair (h_t, token t+1) -> token t+2
    mlog = model.lm_head(m)
    mtp_loss = F.cross_entropy(mlog.float().reshape(-1, mlog.shape[-1]), ids[:, 2:].reshape(-1))
    cfg = model.config
    aux = M.load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok) * aux_coef
    return main, mtp_loss, aux


@torch.no_grad()
def eval_loss(model, mtp, tokens: torch.Tensor, seq: int, device, max_windows: int = 64):
    model.eval(), mtp.eval()
    tot = mtot = 0.0
    n = 0
    for i in range(0, min(len(tokens) - seq - 1, max_windows * seq), seq):
        ids = tokens[i:i + seq][None].to(device)
        main, mloss, _ = losses(model, mtp, ids, 0.0)
        tot, mtot, n = tot + main.item(), mtot + mloss.item(), n + 1
    model.train(), mtp.train()
    return tot / max(n, 1), mtot / max(n, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-minutes", type=float, default=6.0, help="stop early (and say so) after this long")
    ap.add_argument("--tiny", action="store_true", help="a very small model (smoke tests)")
    args = ap.parse_args(argv)
    random.seed(SEED), torch.manual_seed(SEED)
    t_start = time.time()
    dev = torch.device(args.device)

    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    train_f, held_f = split_files(files, root)
    train_texts = [read(f) for f in train_f]
    held_texts = [read(f) for f in held_f]
    corpus_bytes = sum(len(t.encode()) for t in train_texts + held_texts)
    print(f"corpus: {len(files)} files, {corpus_bytes / 1e6:.1f} MB (Python {sys.version.split()[0]}), "
          f"{len(held_f)} held out", flush=True)
    tok = train_tokenizer(train_texts, args.vocab)
    eot = tok.token_to_id("<|endoftext|>")

    def encode(texts):
        ids = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eot)
        return torch.tensor(ids, dtype=torch.long)

    train_tokens, held_tokens = encode(train_texts), encode(held_texts)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; train {len(train_tokens) / 1e6:.2f} M tokens "
          f"({corpus_bytes / (len(train_tokens) + len(held_tokens)):.2f} bytes/token), held out "
          f"{len(held_tokens) / 1e3:.0f} k", flush=True)

    from transformers import Qwen3NextForCausalLM

    cfg = make_config(tok.get_vocab_size(), args.tiny)
    cfg.eos_token_id = eot
    cfg._attn_implementation = "sdpa"
    model = Qwen3NextForCausalLM(cfg).to(dev)
    gdn_kernel = use_fla_chunk(model, dev)
    mtp = MTPHead(cfg).to(dev)
    mtp.apply(model._init_weights)
    n_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters with the MTP head", flush=True)
    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, min(100, args.steps // 10))

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(SEED)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    history, done, t0 = [], 0, time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(train_tokens) - args.seq - 1, (args.batch,), generator=gen)
        ids = torch.stack([train_tokens[s:s + args.seq] for s in starts]).to(dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with amp:
            main_l, mtp_l, aux = losses(model, mtp, ids, cfg.router_aux_loss_coef)
            loss = main_l + 0.3 * mtp_l + aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        history.append((main_l.item(), mtp_l.item()))
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {main_l.item():.3f} mtp {mtp_l.item():.3f} aux {aux.item():.4f} "
                  f"lr {lr_at(step):.2e} ({(time.time() - t0) / done:.3f} s/step)", flush=True)
        if (time.time() - t0) / 60 > args.max_minutes:
            print(f"stopping at step {done} of {args.steps}: time limit", flush=True)
            break

    model.float(), mtp.float()
    held_loss, held_mtp = eval_loss(model, mtp, held_tokens, args.seq, dev)
    train_loss = sum(h[0] for h in history[-50:]) / len(history[-50:])
    # the shipped held-out sample: the first held-out file(s), about 2 KB, with their loss at bf16 weights
    sample = ""
    for t in held_texts:
        sample += t
        if len(sample) > 2000:
            break
    sample = sample[:2000]
    os.makedirs(args.out, exist_ok=True)
    model = model.to(torch.bfloat16)
    mtp = mtp.to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    from safetensors.torch import load_file, save_file

    st = os.path.join(args.out, "model.safetensors")
    tensors = load_file(st)
    tensors.update(mtp.checkpoint_tensors())
    save_file(tensors, st, metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json")) as f:
        cj = json.load(f)
    cj["num_nextn_predict_layers"] = 1
    cj["torch_dtype"] = cj["dtype"] = "bfloat16"
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cj, f, indent=1)
    # chat ends a turn with <|im_end|> (the ChatML template hylo applies to a template-less checkpoint): the
    # generation config lists it beside the end of text, as Qwen's releases do
    gen_path = os.path.join(args.out, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [eot, tok.token_to_id("<|im_end|>")]
    with open(gen_path, "w") as f:
        json.dump(gen, f, indent=2)
    with open(os.path.join(args.out, "heldout_sample.txt"), "w") as f:
        f.write(sample)
    # the sample's loss with the saved (bf16-rounded) weights, computed in float32
    model_f, mtp_f = model.float(), mtp.float()
    sample_ids = torch.tensor(tok.encode(sample).ids)[None].to(dev)
    with torch.no_grad():
        s_main, s_mtp, _ = losses(model_f, mtp_f, sample_ids, 0.0)
    report = {
        "corpus": {"source": "Python standard library .py files, tests excluded", "python": sys.version.split()[0],
                   "files": len(files), "heldout_files": len(held_f), "bytes": corpus_bytes,
                   "heldout_paths": [os.path.relpath(f, root) for f in held_f]},
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "specials": SPECIALS, "train_tokens": len(train_tokens), "heldout_tokens": len(held_tokens)},
        "model": {"parameters": n_params, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                  "layer_types": cfg.layer_types, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok},
        "training": {"steps": done, "planned_steps": args.steps, "batch": args.batch, "seq": args.seq,
                     "lr": args.lr, "seed": SEED, "gdn_kernel": gdn_kernel, "device": torch.cuda.get_device_name() if dev.type == "cuda" else
                     "cpu", "minutes": (time.time() - t_start) / 60, "torch": torch.__version__},
        "loss": {"train_last50": train_loss, "heldout": held_loss, "heldout_mtp_next_next": held_mtp,
                 "heldout_sample_bf16_weights": s_main.item(), "heldout_sample_mtp_bf16_weights": s_mtp.item()},
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "corpus"}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
