"""The RolloutBackend interface the RL loop uses, on the new engine."""

import torch

from miles_core.data.tokenizer import CharTokenizer
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import BuiltinEngine
from miles_core.types import Prompt


def test_generate_groups_logprobs_and_versions():
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64))
    eng = BuiltinEngine(model, tok, torch.device("cpu"), seed=1)
    prompts = [Prompt(text="12+7=", label="19"), Prompt(text="3+4=", label="7")]
    samples = eng.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), n=3)
    assert [s.group_id for s in samples] == [0, 0, 0, 1, 1, 1] and [s.index for s in samples] == list(range(6))
    for s in samples:
        assert s.prompt_ids == tok.encode(s.prompt) and 1 <= len(s.response_ids) <= 5
        assert len(s.rollout_logprobs) == len(s.response_ids) and all(lp <= 0 for lp in s.rollout_logprobs)
        full = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model.lm_head(model(full))[0, len(s.prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=1e-5)  # what the trainer recomputes
    new = Decoder(model.config)
    eng.update_weights(new.state_dict(), version=5)
    assert eng.weight_version == 5
    assert all(s.weight_version == 5 for s in eng.generate(prompts[:1], SamplingParams(max_new_tokens=2), n=2))


def test_rollout_dtype_follows_the_recipe_on_gpu_and_is_checked():
    """rollout.dtype=auto serves in the recipe's compute dtype on CUDA (fp32 masters, bf16 engine), keeps
    the model's dtype on CPU and for a batch-invariant recipe; an explicit dtype wins; a bad one is a ConfigError."""
    import pytest

    from miles_core.errors import ConfigError
    from miles_core.precision.base import PrecisionRecipe
    from miles_core.rollout.config import RolloutConfig
    from miles_core.rollout.plugin import engine_dtype

    bf16 = PrecisionRecipe("bf16", torch.float32, torch.bfloat16)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert engine_dtype("auto", bf16, cuda) is torch.bfloat16
    assert engine_dtype("auto", bf16, cpu) is None
    assert engine_dtype("auto", PrecisionRecipe("fp32"), cuda) is None
    assert engine_dtype("auto", PrecisionRecipe("bi", torch.float32, torch.bfloat16, batch_invariant=True), cuda) is None
    assert engine_dtype("float16", PrecisionRecipe("fp32"), cpu) is torch.float16
    with pytest.raises(ConfigError, match="rollout.dtype must be one of"):
        RolloutConfig(dtype="int8").validate()


def test_bf16_engine_on_cpu_generates_from_fp32_weights():
    """An engine in bf16 built from an fp32 model: weights and KV cache are bf16, weight updates from the
    fp32 trainer land rounded, and its logprobs stay close to the fp32 model's."""
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64))
    eng = BuiltinEngine(model, tok, torch.device("cpu"), seed=1, dtype=torch.bfloat16)
    assert all(p.dtype is torch.bfloat16 for p in eng.model.parameters()) and eng.core.runner.kv.dtype is torch.bfloat16
    s = eng.generate([Prompt(text="12+7=", label="19")], SamplingParams(max_new_tokens=6, temperature=1.0), n=2)[0]
    full = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model.lm_head(model(full))[0, len(s.prompt_ids) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
    assert (torch.tensor(s.rollout_logprobs) - ref).abs().max() < 0.1
    state = {k: v * 0.5 for k, v in model.state_dict().items()}
    eng.update_weights(state, version=2)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(eng.model.state_dict()[name], state[name].to(torch.bfloat16))


def test_rollout_settings_reach_the_engine_config():
    import pytest

    from miles_core.errors import ConfigError
    from miles_core.rollout.config import RolloutConfig
    from miles_core.rollout.plugin import engine_config

    assert engine_config(RolloutConfig()) is None  # the engine's own defaults
    e = engine_config(RolloutConfig(decode_steps=16, kv_memory_fraction=0.1, max_batch_size=64))
    assert (e.decode_steps, e.kv_memory_fraction, e.max_num_seqs) == (16, 0.1, 64)
    e = engine_config(RolloutConfig(kv_memory_fraction=0.2))
    assert (e.decode_steps, e.kv_memory_fraction) == (8, 0.2)
    with pytest.raises(ConfigError, match="rollout.kv_memory_fraction"):
        RolloutConfig(kv_memory_fraction=1.5).validate()
    e = engine_config(RolloutConfig(cpu_kernels="torch"))
    assert (e.cpu_kernels, e.decode_steps) == ("torch", 8)
    with pytest.raises(ConfigError, match="rollout.cpu_kernels"):
        RolloutConfig(cpu_kernels="c").validate()


def test_a_refused_prompt_names_itself_and_leaves_none_of_its_batch_queued():
    import pytest

    from miles_core.errors import DataError
    from miles_core.rollout.engine_core.config import EngineConfig

    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64))
    eng = BuiltinEngine(model, tok, torch.device("cpu"), seed=1, config=EngineConfig(max_model_len=16))
    long = "1+" * 10 + "="
    with pytest.raises(DataError, match=r"rollout prompt '1\+1\+.*: the prompt has 21 tokens; the engine's max_model_len is 16"):
        eng.generate([Prompt(text="1+2="), Prompt(text=long)], SamplingParams(max_new_tokens=4), n=2)
    assert not eng.core.has_unfinished()  # the first prompt's samples were not left to run with the next batch
    samples = eng.generate([Prompt(text="3+4=")], SamplingParams(max_new_tokens=4), n=2)
    assert [s.prompt for s in samples] == ["3+4=", "3+4="] and eng.core.requests == {}
