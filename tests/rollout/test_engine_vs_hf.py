"""The engine against transformers: greedy tokens identical, logprobs within 1e-5 (fp32, CPU)."""

import pytest
import torch
from helpers import hf_config, load_miles, make_hf_model, save_random_hf

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore

PROMPTS = [[5, 17, 3, 44, 9, 21, 60, 2, 11], [7, 70, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 12


def run_all(core, prompts, params):
    reqs = [core.add_request(p, params)[0] for p in prompts]
    while core.has_unfinished():
        core.step()
    return reqs


@pytest.mark.parametrize("head_dim", [8, 16])  # 16: the CPU decode window runs its fused C kernels where they build
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_and_logprobs_match_transformers(family, head_dim, tmp_path):
    hf = make_hf_model(family, tmp_path, head_dim=head_dim)
    core = EngineCore(load_miles(tmp_path), EngineConfig(block_size=4, decode_steps=3, max_batched_tokens=8))
    reqs = run_all(core, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0, top_logprobs=3))
    for prompt, req in zip(PROMPTS, reqs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
        assert req.output_ids == ref.tolist()
        assert req.finish_reason == "length"
        full = torch.tensor([prompt + req.output_ids])
        with torch.no_grad():
            logits = hf(full).logits[0, len(prompt) - 1 : -1]
        ref_all = torch.log_softmax(logits, -1)
        ref_lp = ref_all.gather(-1, torch.tensor(req.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(req.logprobs), ref_lp, atol=1e-5, rtol=0)
        top = torch.topk(ref_all, 3, dim=-1)  # the top-3 alternatives at every position: the same ids, the same values
        assert [[t for t, _ in row] for row in req.top_logprobs] == top.indices.tolist()
        assert torch.allclose(torch.tensor([[lp for _, lp in row] for row in req.top_logprobs]), top.values, atol=1e-5, rtol=0)
    assert len({t for r in reqs for t in r.output_ids}) > 3  # not a degenerate one-token model


# Llama 3.1-3.3's frequency-dependent scaling and linear interpolation; the pretraining context of 16 tokens puts the
# prompts and outputs past it and most frequencies in the scaled or the mixed band
SCALED_ROPE = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize("head_dim", [8, 16])
@pytest.mark.parametrize("scaling", sorted(SCALED_ROPE))
def test_scaled_rope_matches_transformers(scaling, head_dim, tmp_path):
    from miles_core.models import rope

    hf = save_random_hf(hf_config("llama", head_dim, SCALED_ROPE[scaling]), tmp_path)
    miles = load_miles(tmp_path)
    assert miles.config.rope_scaling["rope_type"] == scaling
    plain = rope.inv_freq(head_dim, 10000.0)
    assert not torch.allclose(miles.inv_freq, plain)  # the scaling changes the frequencies here
    assert torch.equal(miles.inv_freq, hf.model.rotary_emb.inv_freq)
    core = EngineCore(miles, EngineConfig(block_size=4, decode_steps=3, max_batched_tokens=8))
    reqs = run_all(core, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))
    for prompt, req in zip(PROMPTS, reqs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
        assert req.output_ids == ref.tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + req.output_ids])).logits[0, len(prompt) - 1 : -1]
        ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(req.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(req.logprobs), ref_lp, atol=1e-5, rtol=0)


def test_a_checkpoint_miles_does_not_implement_is_refused_with_the_reason(tmp_path):
    """Loading for training names what Miles lacks; ``miles serve`` runs it through transformers instead,
    with transformers' own greedy tokens (never the plain-RoPE function under a scaled checkpoint's name)."""
    from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
    from miles_core.errors import ConfigError
    from miles_core.plugins.manager import MilesPlugins
    from miles_core.serve.app import load_model

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    hf = save_random_hf(hf_config("llama", 8, yarn), tmp_path)
    (tmp_path / CHAR_TOKENIZER_FILE).write_text(CharTokenizer().to_json())
    with pytest.raises(ConfigError, match="RoPE scaling 'yarn'"):
        load_miles(tmp_path)
    model, _tok = load_model(str(tmp_path), MilesPlugins())
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=2))
    (req,) = run_all(core, PROMPTS[:1], SamplingParams(max_new_tokens=NEW, temperature=0))
    ids = torch.tensor([PROMPTS[0]])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:]
    assert req.output_ids == ref.tolist()


def test_moe_routed_experts_match_transformers_router(tmp_path):
    hf = make_hf_model("qwen3_moe", tmp_path)
    core = EngineCore(load_miles(tmp_path), EngineConfig(block_size=4, decode_steps=2))
    (req,) = run_all(core, PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0))
    seen = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o, li=li: seen.__setitem__(li, o[2]))
             for li, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        hf(torch.tensor([req.prompt_ids + req.output_ids[:-1]]))
    for h in hooks:
        h.remove()
    routed = torch.cat(req.routed_experts)  # [tokens fed, layers, k]
    assert routed.shape == (len(req.prompt_ids) + 5, 2, 2)
    for li in range(2):
        assert torch.equal(routed[:, li].sort(-1).values, seen[li].sort(-1).values)


def test_moe_group_samples_carry_their_prompts_routing(tmp_path):
    """The samples of a group forked from their leader get the prompt's routing from it: each sample's
    routing (prompt + the tokens it fed) equals that of the same sample decoded alone."""
    make_hf_model("qwen3_moe", tmp_path)
    model = load_miles(tmp_path)
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=2))
    group = core.add_request(PROMPTS[0], SamplingParams(max_new_tokens=6, temperature=1.0, seed=4), n=3)
    while core.has_unfinished():
        core.step()
    assert group[1].num_cached == len(PROMPTS[0])  # forked: nothing of the prompt recomputed
    for i, g in enumerate(group):
        (alone,) = run_all(EngineCore(model, EngineConfig(block_size=4, decode_steps=2)), PROMPTS[:1],
                           SamplingParams(max_new_tokens=6, temperature=1.0, seed=4 + i))
        assert g.output_ids == alone.output_ids
        routed = torch.cat(g.routed_experts)
        assert routed.shape == (len(PROMPTS[0]) + 5, 2, 2) and torch.equal(routed, torch.cat(alone.routed_experts))


def test_moe_requests_outside_a_group_do_not_reuse_cached_prefixes(tmp_path):
    """Routing is recorded for the tokens a request feeds: a prompt found in the prefix cache would have none for its
    cached tokens, so a MoE engine reuses prefixes only inside a group (whose leader's routing is copied)."""
    make_hf_model("qwen3_moe", tmp_path)
    core = EngineCore(load_miles(tmp_path), EngineConfig(block_size=4, decode_steps=2))
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    (first,) = run_all(core, PROMPTS[:1], greedy)
    (again,) = run_all(core, PROMPTS[:1], greedy)
    assert again.num_cached == 0 and again.output_ids == first.output_ids
    assert torch.equal(torch.cat(again.routed_experts), torch.cat(first.routed_experts))


def test_a_moe_config_without_num_experts_per_tok_routes_to_transformers_default(tmp_path):
    """A Qwen3-MoE config.json without ``num_experts_per_tok`` routes each token to transformers' default, 8
    experts (Miles took 2: other logits, silently)."""
    import json

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, moe_intermediate_size=16, num_experts=8, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    save_random_hf(cfg, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_experts_per_tok"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = load_miles(tmp_path)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(ours.lm_head(ours(ids)), hf(ids).logits, rtol=1e-4, atol=1e-5)


def test_moe_routing_of_a_preempted_request_is_recorded_once(tmp_path):
    """A preempted request is recomputed from its first token: its routing is that of the tokens it fed, once, as when
    it runs alone (the routing from before the preemption was kept and the recomputed prefix appended to it)."""
    make_hf_model("qwen3_moe", tmp_path)
    model = load_miles(tmp_path)
    params = SamplingParams(max_new_tokens=20, temperature=0.7, seed=3)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:13]]
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, max_batched_tokens=3, num_blocks=12, max_model_len=40))
    reqs = [core.add_request(p, params)[0] for p in prompts]
    preempted = set()
    while core.has_unfinished():
        core.step()
        preempted |= {r.request_id for r in core.scheduler.waiting if r.output_ids}
    assert preempted  # the tiny pool forces preemption
    for prompt, req in zip(prompts, reqs):
        (alone,) = run_all(EngineCore(model, EngineConfig(block_size=4, decode_steps=3, prefix_caching=False)), [prompt], params)
        assert req.output_ids == alone.output_ids
        routed = torch.cat(req.routed_experts)
        assert routed.shape == (len(prompt) + len(req.output_ids) - 1, 2, 2)
        assert torch.equal(routed, torch.cat(alone.routed_experts))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_bf16_copy_keeps_fp32_rotary_frequencies(family, tmp_path):
    """Cast to bf16 (the engine's serving copy under train.precision=bf16 on GPU, ``miles serve --dtype bfloat16``), the
    decoder keeps its rotary frequencies in fp32 as transformers does, and as the trainer's fp32 master copy has them:
    rounded to bf16 they are off by up to 0.4%, the rotary angles at position ~4000 by more than 1 rad."""
    from transformers import AutoModelForCausalLM

    make_hf_model(family, tmp_path, head_dim=16)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = load_miles(tmp_path).to(torch.bfloat16)
    assert next(ours.parameters()).dtype == torch.bfloat16
    assert ours.inv_freq.dtype == torch.float32 and torch.equal(ours.inv_freq, hf.model.rotary_emb.inv_freq)
    pos = torch.arange(4000, 4096)[None]
    cos, sin = ours._rope(pos, torch.bfloat16)
    ref_cos, ref_sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), pos)
    assert torch.equal(cos[:, 0], ref_cos) and torch.equal(sin[:, 0], ref_sin)
