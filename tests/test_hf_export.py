"""The trainer's HF export loads in transformers and gives the same logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from miles_core.plugins.manager import MilesPlugins

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_trainer, policy_loss, random_batch, tiny_decoder  # noqa: E402


@pytest.mark.parametrize("tie", [True, False])
def test_export_loads_in_transformers_with_same_logits(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    trainer = make_trainer(tiny_decoder(tie=tie))
    batch = random_batch(4)
    trainer.train_step(batch, policy_loss(trainer))  # export trained (not initial) weights
    family = MilesPlugins().registries.model_families.get("qwen3", key="model.family")
    trainer.export_hf(family, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    ids = batch.input_ids[:2, :8]
    with torch.no_grad():
        ours = trainer.model.lm_head(trainer.model(ids))
        theirs = hf(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_scaled_rope_survives_export_and_loads_in_transformers(tmp_path):
    """A Llama-3.1-style scaled RoPE is written to config.json: transformers reads back the same frequencies and logits."""
    transformers = pytest.importorskip("transformers")
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.models.decoder import Decoder, DecoderConfig

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, rope_scaling=scaling)).eval()
    save_hf_folder(model, MilesPlugins().registries.model_families.get("llama"), tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert torch.equal(hf.model.rotary_emb.inv_freq, model.inv_freq)
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        assert torch.allclose(model.lm_head(model(ids)), hf(input_ids=ids).logits, atol=1e-5)


@pytest.mark.parametrize("extra, reason", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "RoPE scaling 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without low_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, "partial rotary"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"attention_bias": True}, "attention biases"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
])
def test_what_a_family_does_not_implement_is_named(extra, reason):
    from miles_core.errors import ConfigError
    from miles_core.train.megatron.arch import arch_from_hf

    family = MilesPlugins().registries.model_families.get("llama")
    hf = {**family.config_to_hf(tiny_decoder().config), "model_type": "llama"}
    assert family.unsupported(hf) is None
    assert reason in family.unsupported({**hf, **extra})
    if "rope" in next(iter(extra)):  # the Megatron trainer builds plain RoPE only
        with pytest.raises(ConfigError, match="plain RoPE"):
            arch_from_hf({**hf, **extra})


def test_rope_frequencies_hand_worked():
    from miles_core.models.rope import inv_freq, scaling_from_hf, theta_from_hf

    plain = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    assert torch.allclose(inv_freq(8, 100.0), plain)
    assert torch.allclose(inv_freq(8, 100.0, {"rope_type": "linear", "factor": 4.0}), plain / 4)
    # transformers 5 keeps the base inside rope_parameters
    assert theta_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}) == 5e5
    assert theta_from_hf({"rope_theta": 1e6}) == 1e6 and theta_from_hf({}) == 10000.0
    assert scaling_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}) is None
    assert scaling_from_hf({"rope_scaling": {"type": "linear", "factor": 2.0}}) == {"rope_type": "linear", "factor": 2.0}


def test_a_checkpoint_of_an_hf_tokenizer_run_reloads_with_its_tokenizer(tmp_path):
    """--save writes step_N/hf (what --resume builds the model and tokenizer from) and DIR/hf with
    tokenizer_files(tokenizer): a run on an HF tokenizer (an HF folder, SmolLM2's GGUF) wrote no tokenizer there,
    so --resume failed with 'cannot load a tokenizer', and DIR/hf did not load in transformers as a whole."""
    from miles_core.testing.tokenizers import byte_level_bpe

    from miles_core.data.tokenizer import HFTokenizer, load_tokenizer
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.orchestration.build import tokenizer_files

    tok = HFTokenizer.wrap(byte_level_bpe("reverse the string: abcdef",
                                          chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"))
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64))
    save_hf_folder(model, MilesPlugins(autoload=False).registries.model_families.get("llama"), tmp_path / "hf", tokenizer_files(tok))
    back = load_tokenizer(tmp_path / "hf")
    text = "reverse the string: fedcba"
    assert back.encode(text) == tok.encode(text) and back.vocab_size == tok.vocab_size and back.eos_token_id == tok.eos_token_id
    messages = [{"role": "user", "content": text}]
    assert back.render_chat(messages) == tok.render_chat(messages)


def test_an_hf_model_s_own_eos_ids_end_rl_rollouts_and_travel_with_its_checkpoints(tmp_path):
    """The built-in engine stopped on the tokenizer's one eos only, not on the ids the model's generation_config.json
    names (Llama 3 Instruct ends turns with <|eot_id|> while its tokenizer's eos is <|end_of_text|>): its RL rollouts ran
    on to max_response_len where SGLang and HF generate stop. And a checkpoint's folder lost those ids (the saved
    config.json names none), so a resumed run or an exported model stopped on fewer."""
    import json

    import torch
    from miles_core.testing.tokenizers import byte_level_bpe

    from miles_core.data.tokenizer import load_tokenizer
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.orchestration.build import tokenizer_files
    from miles_core.rollout.base import SamplingParams
    from miles_core.rollout.engine import BuiltinEngine
    from miles_core.types import Prompt

    src = tmp_path / "src"
    byte_level_bpe("reverse the string: abcdef").save_pretrained(src)
    tok = load_tokenizer(src)
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64))
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    free = BuiltinEngine(model, tok, torch.device("cpu"), 4).generate([Prompt("reverse the string: ab")], greedy)[0]
    stop = free.response_ids[0]  # the free answer's first token, made the model's own end-of-turn id
    assert len(free.response_ids) == 8 and stop != tok.eos_token_id
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, stop], "temperature": 0.6}))
    tok = load_tokenizer(src)
    assert tok.stop_token_ids == [tok.eos_token_id, stop]
    ended = BuiltinEngine(model, tok, torch.device("cpu"), 4).generate([Prompt("reverse the string: ab")], greedy)[0]
    assert ended.response_ids == [stop] and ended.finish_reason == "stop"
    save_hf_folder(model, MilesPlugins(autoload=False).registries.model_families.get("llama"), tmp_path / "ckpt", tokenizer_files(tok))
    assert json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())["temperature"] == 0.6  # the file as it was
    assert load_tokenizer(tmp_path / "ckpt").stop_token_ids == [tok.eos_token_id, stop]


def _folder_without_eos(path: Path, generation_eos: int | None) -> None:
    """A llama folder whose tokenizer names no eos (nor pad); ``generation_eos``: the id its generation_config.json
    names (what the model itself stops on), else none anywhere."""
    import json

    from miles_core.testing.tokenizers import byte_level_bpe

    from miles_core.data.tokenizer import HFTokenizer
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.orchestration.build import tokenizer_files

    tok = HFTokenizer.wrap(byte_level_bpe("reverse the string: abcdef", ("<end>",), eos=None))
    assert tok.eos_token_id is None and tok.pad_token_id is None
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64))
    save_hf_folder(model, MilesPlugins(autoload=False).registries.model_families.get("llama"), path, tokenizer_files(tok))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [generation_eos]}))


def test_a_tokenizer_without_eos_takes_the_model_s_own(tmp_path):
    """A tokenizer that names no eos put None into every SFT response (and into reference answers), and padded with
    None: make_train_batch then failed with "full(): argument 'fill_value' must be Number, not NoneType". The id
    the model's generation_config.json names is its eos: it closes SFT responses and pads."""
    from miles_core.data.sft import sft_sample
    from miles_core.data.tokenizer import load_tokenizer
    from miles_core.train.batch import make_train_batch

    _folder_without_eos(tmp_path / "hf", generation_eos=0)
    tok = load_tokenizer(tmp_path / "hf")
    assert (tok.eos_token_id, tok.pad_token_id, tok.stop_token_ids) == (0, 0, [0])
    sample = sft_sample("reverse the string: ab", [("ba", True)], tok, 0)
    assert sample.response_ids == tok.encode("ba") + [0] and sample.loss_mask == [1] * len(sample.response_ids)
    assert make_train_batch([sample], tok.pad_token_id).input_ids[0].tolist() == sample.prompt_ids + sample.response_ids


@pytest.mark.parametrize("mode, message", [
    (["run.mode=sft"], r"has no eos token .*: run.mode=sft ends every response with it"),
    (["train.sft_warmup_steps=2"], r"has no eos token .*: train.sft_warmup_steps ends every response with it"),
    (["run.mode=rl"], r"has neither a pad nor an eos token: training batches are padded with one"),
])
def test_a_tokenizer_without_any_eos_is_refused_at_start_up(tmp_path, mode, message):
    from miles_core.config.loader import load_config
    from miles_core.errors import ConfigError
    from miles_core.orchestration.build import build

    _folder_without_eos(tmp_path / "hf", generation_eos=None)
    cfg = load_config(None, [f"model.hf_checkpoint={tmp_path / 'hf'}", *mode])
    with pytest.raises(ConfigError, match=f"^the tokenizer of '{tmp_path / 'hf'}' {message}"):
        build(cfg, MilesPlugins(), None)
    build(load_config(None, [f"model.hf_checkpoint={tmp_path / 'hf'}", "run.mode=rollout"]), MilesPlugins(), None)  # trains on nothing
