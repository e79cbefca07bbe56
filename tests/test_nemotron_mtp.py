"""Nemotron-H's MTP head as the drafter (``models.nemotron_mtp``). transformers drops ``mtp.*`` tensors, so the
checkpoint's MTP blocks are written here under the releases' names (Nemotron 3 Super: ``mtp.layers.0`` the
attention block with enorm / hnorm / eh_proj, ``mtp.layers.1`` the MoE block with final_layernorm) from a second
transformers model whose blocks are those two; that model, fed the fused inputs, is the reference of the head."""

import pytest
import torch
import torch.nn.functional as F

from hylo import SamplingParams
from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.speculative.setup import SpecSetup

from helpers import make_nemotron3_checkpoint, random_prompts, run_all


def _hf_norm(x, w, eps):
    """transformers' NemotronHRMSNorm: normalised in float32, the weight applied in float32."""
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _reference_drafts(hf, blocks, fusion, prompt, first_token, k):
    """The head's greedy drafts after a prefill of ``prompt`` whose sampled token is ``first_token``, from
    transformers' blocks: every position j feeds (the target's normed hidden at j, the token at j + 1), then each
    chained step feeds (its own previous output, its previous draft) at the next position."""
    eps = hf.config.layer_norm_epsilon
    ids = torch.tensor([prompt + [first_token]])
    with torch.no_grad():
        hidden = hf.model(ids[:, :-1]).last_hidden_state[0] if hasattr(hf, "model") else \
            hf.backbone(ids[:, :-1]).last_hidden_state[0]
        embed = hf.get_input_embeddings()
        tokens, hid = ids[0, 1:], hidden  # pairs (hidden at j, token at j + 1)
        drafts = []
        for _ in range(k):
            e = _hf_norm(embed(tokens), fusion["enorm"], eps)
            x = F.linear(torch.cat([e, _hf_norm(hid, fusion["hnorm"], eps)], -1), fusion["eh_proj"])
            out = blocks(inputs_embeds=x[None]).last_hidden_state[0]
            draft = int(hf.lm_head(out[-1]).argmax())
            drafts.append(draft)
            tokens = torch.cat([tokens, torch.tensor([draft])])
            hid = torch.cat([hid, out[-1:]])  # the head's own output feeds the next step
    return drafts


def test_config_and_head_read_as_released(nemotron_mtp):
    path = nemotron_mtp[0]
    eng = Engine(path, device="cpu", dtype="float32", spec_setup=SpecSetup("mtp"),
                 engine_config=EngineConfig(speculative="mtp", num_speculative_tokens=3, verbose=False))
    head = eng.worker.drafter.mtp
    assert eng.model.config.mtp_layer_types == ("full_attention", "moe")
    assert [b.kind for b in head.blocks] == ["full_attention", "moe"]
    assert head.num_kv_layers == 1 and head.blocks[0].mixer.layer_id == eng.model.config.num_hidden_layers


def test_drafts_match_the_heads_function_built_from_transformers_blocks(nemotron_mtp):
    """The drafts after a prefill, greedy: the head's attention over every prompt position (its own KV), the MoE
    block, the final norm, the chained steps; against the same function of transformers' blocks."""
    path, hf, blocks, fusion = nemotron_mtp
    k = 3
    eng = Engine(path, device="cpu", dtype="float32", spec_setup=SpecSetup("mtp"),
                 engine_config=EngineConfig(speculative="mtp", num_speculative_tokens=k, spec_policy="fixed",
                                            overlap=False, enable_prefix_caching=False, verbose=False))
    drafter = eng.worker.drafter
    for prompt in random_prompts(hf.config.vocab_size, [9, 17], seed=21):
        rid = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0))
        req = eng._reqs[rid]
        for _ in range(50):
            eng.step()
            if req.output_ids:
                break
        first = req.output_ids[0]
        drafts = drafter.drafts[req.req_slot].tolist()
        assert drafts == _reference_drafts(hf, blocks, fusion, prompt, first, k)
        while not req.finished:
            eng.step()


def test_mtp_speculation_is_lossless(nemotron_mtp):
    """Greedy outputs with the head drafting equal plain decoding's, over mixed lengths and chunked prefill."""
    path, hf, _, _ = nemotron_mtp
    prompts = random_prompts(hf.config.vocab_size, [5, 30, 12, 3], seed=22)
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = run_all(Engine(path, device="cpu", dtype="float32",
                           engine_config=EngineConfig(chunk_size=11, verbose=False)), prompts, params)
    eng = Engine(path, device="cpu", dtype="float32", spec_setup=SpecSetup("mtp"),
                 engine_config=EngineConfig(speculative="mtp", num_speculative_tokens=3, spec_policy="fixed",
                                            chunk_size=11, verbose=False))
    spec = run_all(eng, prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_a_checkpoint_without_mtp_layers_refuses_mtp_by_name(tmp_path):
    path, _ = make_nemotron3_checkpoint(str(tmp_path / "n3"))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0.*ngram"):
        Engine(path, device="cpu", dtype="float32", spec_setup=SpecSetup("mtp"),
               engine_config=EngineConfig(speculative="mtp", verbose=False))


def test_which_shapes_draft_with_mtp(nemotron_mtp, tmp_path):
    """``has_mtp_head`` (the bench's and the profiler's choice of drafter): a family with a head and a checkpoint
    with its layers; Nemotron 3 Nano's release and the Nemotron-H shapes (the family has a head, the checkpoints
    none) fall back to n-gram."""
    from hylo.bench.shapes import bench_config
    from hylo.models.registry import has_mtp_head, read_config

    path, _ = make_nemotron3_checkpoint(str(tmp_path / "n3"))
    assert has_mtp_head(read_config(nemotron_mtp[0]))
    assert not has_mtp_head(read_config(path))
    assert has_mtp_head(bench_config("bench-6b")) and has_mtp_head(bench_config("qwen3-next-80b-fp8"))
    assert not has_mtp_head(bench_config("nemotron-3-nano-30b-a3b"))
    assert not has_mtp_head(bench_config("nemotron-h-8b"))
