"""The engine against transformers: greedy tokens identical, logprobs within 1e-5 (fp32, CPU)."""

import pytest
import torch
from helpers import load_miles, make_hf_model

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
    reqs = run_all(core, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))
    for prompt, req in zip(PROMPTS, reqs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
        assert req.output_ids == ref.tolist()
        assert req.finish_reason == "length"
        full = torch.tensor([prompt + req.output_ids])
        with torch.no_grad():
            logits = hf(full).logits[0, len(prompt) - 1 : -1]
        ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(req.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(req.logprobs), ref_lp, atol=1e-5, rtol=0)
    assert len({t for r in reqs for t in r.output_ids}) > 3  # not a degenerate one-token model


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
