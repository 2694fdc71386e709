"""Architectures with no Miles family run through transformers' own modules over the engine's paged
KV cache (transformers_runner.py): greedy tokens identical to ``generate``, logprobs within 1e-5 of
a full forward (fp32, CPU), and the engine's features (prefix sharing, seeds, aborts, weight
updates, memory release) unchanged."""

import pytest
import torch
from helpers import save_random_hf

from miles_core.errors import ConfigError, MilesUserError
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore
from miles_core.rollout.engine_core.transformers_runner import TransformersRunner, load_transformers_model

VOCAB = 96
PROMPTS = [[5, 17, 3, 44, 9, 21, 60, 2, 11], [7, 70, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 14


def config(arch: str, **over):
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    gqa = dict(common, num_key_value_heads=2)
    make = {
        "qwen2": lambda: T.Qwen2Config(**gqa),  # q/k/v biases
        "mistral": lambda: T.MistralConfig(sliding_window=8, **gqa),  # a window shorter than the sequences
        "gpt_neox": lambda: T.GPTNeoXConfig(**common),  # partial rotary, parallel residual, LayerNorm
        "granite": lambda: T.GraniteConfig(attention_multiplier=0.3, embedding_multiplier=2.0, logits_scaling=1.5,
                                           residual_multiplier=0.7, **gqa),  # its own attention scale
        "phi3": lambda: T.Phi3Config(**gqa),  # fused qkv and gate/up weights
        "mixtral": lambda: T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **gqa),  # MoE (routing not recorded)
        "gemma2": lambda: T.Gemma2Config(head_dim=8, **gqa),  # attention logit soft-capping: refused
    }[arch]
    cfg = make()
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def make_model(arch: str, path, seed: int = 0, **over):
    """A random fp32 transformers model saved under ``path``; returns it (eval)."""
    return save_random_hf(config(arch, **over), path, seed)


def run_all(core, prompts, params, n=1):
    reqs = [r for p in prompts for r in core.add_request(p, params, n=n)]
    while core.has_unfinished():
        core.step()
    return reqs


def hf_greedy(hf, prompt, new=NEW):
    ids = torch.tensor([prompt])
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()


def hf_logprobs(hf, prompt, output):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gpt_neox", "granite", "phi3", "mixtral"])
def test_greedy_and_logprobs_match_transformers(arch, tmp_path):
    hf = make_model(arch, tmp_path)
    model = load_transformers_model(tmp_path)
    core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, max_batched_tokens=8))  # chunked prefill
    assert isinstance(core.runner, TransformersRunner)
    reqs = run_all(core, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))
    for prompt, req in zip(PROMPTS, reqs):
        assert req.output_ids == hf_greedy(hf, prompt)
        assert req.finish_reason == "length"
        assert torch.allclose(torch.tensor(req.logprobs), hf_logprobs(hf, prompt, req.output_ids), atol=1e-5, rtol=0)
    assert len({t for r in reqs for t in r.output_ids}) > 3  # not a degenerate one-token model


def test_the_sliding_window_is_applied(tmp_path):
    """The mistral case above is only a test of the window if the window changes the answer."""
    windowed = make_model("mistral", tmp_path / "w")
    full = make_model("mistral", tmp_path / "f", sliding_window=None)
    prompt = PROMPTS[2]
    assert hf_greedy(windowed, prompt) != hf_greedy(full, prompt)
    core = EngineCore(load_transformers_model(tmp_path / "f"), EngineConfig(block_size=4, decode_steps=3))
    assert run_all(core, [prompt], SamplingParams(max_new_tokens=NEW, temperature=0))[0].output_ids == hf_greedy(full, prompt)
    # decode windows longer than the sliding window: the window's own new tokens fall out of it too
    core = EngineCore(load_transformers_model(tmp_path / "w"), EngineConfig(block_size=4, decode_steps=12))
    assert run_all(core, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))[2].output_ids == hf_greedy(windowed, prompt)


def test_a_sliding_window_the_model_does_not_pass_to_attention_is_applied(tmp_path):
    """Qwen2-MoE keeps its sliding layers' window on the attention module (``sliding_window``) and applies it through
    the mask only, not the attention call's keyword: the engine attended over the whole context (other tokens)."""
    import transformers as T

    cfg = T.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2, use_sliding_window=True, sliding_window=4, max_window_layers=2,
                           max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    hf = save_random_hf(cfg, tmp_path)
    core = EngineCore(load_transformers_model(tmp_path), EngineConfig(block_size=4, decode_steps=3, max_batched_tokens=8))
    reqs = run_all(core, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))
    for prompt, req in zip(PROMPTS, reqs):
        assert req.output_ids == hf_greedy(hf, prompt)
        assert torch.allclose(torch.tensor(req.logprobs), hf_logprobs(hf, prompt, req.output_ids), atol=1e-5, rtol=0)


def test_a_sliding_window_only_in_the_config_is_applied(tmp_path):
    """PhiMoE applies ``config.sliding_window`` through its mask alone: neither the attention call nor the module
    carries it, so the engine attended over the whole context (other tokens than transformers' own)."""
    import transformers as T

    def phimoe(window):
        return T.PhimoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)

    hf = save_random_hf(phimoe(4), tmp_path / "w")
    assert hf_greedy(hf, PROMPTS[2]) != hf_greedy(save_random_hf(phimoe(None), tmp_path / "f"), PROMPTS[2])  # the window matters
    core = EngineCore(load_transformers_model(tmp_path / "w"), EngineConfig(block_size=4, decode_steps=3, max_batched_tokens=8))
    reqs = run_all(core, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))
    for prompt, req in zip(PROMPTS, reqs):
        assert req.output_ids == hf_greedy(hf, prompt)
        assert torch.allclose(torch.tensor(req.logprobs), hf_logprobs(hf, prompt, req.output_ids), atol=1e-5, rtol=0)


def test_engine_features_on_the_transformers_path(tmp_path):
    hf = make_model("qwen2", tmp_path / "a")
    core = EngineCore(load_transformers_model(tmp_path / "a"), EngineConfig(block_size=4, decode_steps=2, kv_tokens_cpu=1024))
    # n samples share the prompt's pages; a per-request seed reproduces a sample
    prompt = PROMPTS[2]
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    group = run_all(core, [prompt], sampled, n=4)
    assert len({tuple(r.output_ids) for r in group}) > 1
    again = run_all(core, [prompt], sampled, n=4)
    assert [r.output_ids for r in again] == [r.output_ids for r in group]
    assert all(r.num_cached >= 16 for r in again)  # the prompt's four full pages came from the prefix cache
    # an abort in mid-generation
    (long,) = core.add_request(PROMPTS[0], SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True))
    for _ in range(4):
        core.step()
    assert core.abort(long.request_id)
    core.step()
    assert long.finish_reason == "abort" and 0 < len(long.output_ids) < 100 and not core.has_unfinished()
    # weights updated in place from another model's tensors: the answers become that model's
    other = make_model("qwen2", tmp_path / "b", seed=1)
    core.update_weights(other.state_dict(), version=3)
    assert core.weight_version == 3
    (req,) = run_all(core, [PROMPTS[1]], SamplingParams(max_new_tokens=NEW, temperature=0))
    assert req.output_ids == hf_greedy(other, PROMPTS[1]) != hf_greedy(hf, PROMPTS[1])
    # memory released and resumed
    core.release_memory()
    with pytest.raises(MilesUserError, match="released"):
        core.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2))
    core.resume_memory()
    (req,) = run_all(core, [PROMPTS[1]], SamplingParams(max_new_tokens=NEW, temperature=0))
    assert req.output_ids == hf_greedy(other, PROMPTS[1])


def test_unsupported_models_are_refused_clearly(tmp_path):
    make_model("gemma2", tmp_path / "g")
    with pytest.raises(ConfigError, match="soft-caps its attention logits"):
        load_transformers_model(tmp_path / "g")
    with pytest.raises(ConfigError, match="cannot load it"):
        load_transformers_model(tmp_path)  # no config.json
    make_model("qwen2", tmp_path / "q")
    with pytest.raises(ConfigError, match="exact_attention"):
        EngineCore(load_transformers_model(tmp_path / "q"), EngineConfig(exact_attention=True))
    # A layer whose attention bypasses transformers' attention interface (stood in for here by replacing one
    # layer's forward with a plain SDPA that keeps no cache) cannot be served: the engine says so
    model = load_transformers_model(tmp_path / "q")
    attn = model.model.layers[1].self_attn

    def bypass(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        n = hidden_states.shape[1]
        q = attn.q_proj(hidden_states).view(1, n, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(hidden_states).view(1, n, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(hidden_states).view(1, n, -1, attn.head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).reshape(1, n, -1)), None

    attn.forward = bypass
    core = EngineCore(model, EngineConfig(block_size=4))
    core.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2))
    with pytest.raises(ConfigError, match="1 of its 2 layers attended"):
        core.step()


def llama4(path, **over):
    import transformers as T

    cfg = T.Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, intermediate_size=64, intermediate_size_mlp=64, num_local_experts=2,
                             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None, **over)
    return save_random_hf(cfg, path)


@pytest.mark.parametrize("over,reason", [
    (dict(attention_chunk_size=4), "chunked attention"),  # the chunks reach attention only as its mask
    (dict(attention_chunk_size=None, floor_scale=2, attn_scale=0.5), "attn_temperature_tuning"),  # positions from HF's cache
])
def test_attention_that_depends_on_positions_otherwise_is_refused(tmp_path, over, reason):
    """Llama 4's chunked attention and query temperature tuning gave other tokens than transformers' (silently):
    refused at load. Without them, Llama 4 serves with transformers' greedy tokens."""
    llama4(tmp_path / "r", **over)
    with pytest.raises(ConfigError, match=reason):
        load_transformers_model(tmp_path / "r")
    hf = llama4(tmp_path / "p", attention_chunk_size=None, attn_temperature_tuning=False, floor_scale=2, attn_scale=0.5)
    core = EngineCore(load_transformers_model(tmp_path / "p"), EngineConfig(block_size=4, decode_steps=3, max_batched_tokens=8))
    (req,) = run_all(core, [PROMPTS[2]], SamplingParams(max_new_tokens=NEW, temperature=0))
    assert req.output_ids == hf_greedy(hf, PROMPTS[2])


def test_alibi_is_refused_at_load(tmp_path):
    """Falcon's ALiBi bias travels in the attention mask, which the paged path does not read: its first step failed
    with an AttributeError from inside transformers; refused at load, naming it."""
    import transformers as T

    save_random_hf(T.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None), tmp_path)
    with pytest.raises(ConfigError, match="ALiBi"):
        core = EngineCore(load_transformers_model(tmp_path), EngineConfig(block_size=4))
        run_all(core, [PROMPTS[0]], SamplingParams(max_new_tokens=2, temperature=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transformers_path_on_cuda(tmp_path):
    """fp32 on the GPU (TF32 off, so that both sides round alike): the same greedy tokens as transformers."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = make_model("qwen2", tmp_path).to("cuda")
    core = EngineCore(load_transformers_model(tmp_path).to("cuda"), EngineConfig(block_size=4, decode_steps=3, num_blocks=64))
    reqs = run_all(core, PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))
    for prompt, req in zip(PROMPTS, reqs):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(prompt):]
        assert req.output_ids == ref.tolist()
