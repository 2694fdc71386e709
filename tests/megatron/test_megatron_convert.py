"""HF <-> Megatron weight conversion: exact round trips, and the layout checked against megatron-core."""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import VOCAB, batch, hf_model, hf_response_logprobs

from miles_core.train.megatron import convert
from miles_core.train.megatron.arch import arch_from_hf


def _hf_state(model_type):
    model = hf_model(model_type)
    state = convert.split_fused_experts(dict(model.state_dict()))
    arch = arch_from_hf(model.config.to_dict())
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return arch, state


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_exact(model_type, tp):
    arch, hf = _hf_state(model_type)
    padded = -(-VOCAB // tp) * tp
    shards = [convert.hf_to_megatron(hf, arch, padded, tp, r) for r in range(tp)]
    if tp == 2:  # every sharded tensor is really split; padding rows are zero
        assert shards[0]["embedding.word_embeddings.weight"].shape[0] == padded // 2 == 31
        assert shards[1]["embedding.word_embeddings.weight"][-1].abs().sum() == 0
        assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 8 // 2, 32)
    back = convert.megatron_to_hf(shards, arch)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_fused_qkv_layout_by_hand():
    """4 query heads, 2 KV groups, head_dim 1: group g holds q[2g], q[2g+1], k[g], v[g]."""
    arch, hf = _hf_state("llama")
    arch = type(arch)(**{**arch.__dict__, "hidden_size": 1, "head_dim": 1})
    q, k, v = torch.tensor([[0.0], [1.0], [2.0], [3.0]]), torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    fused = convert._qkv(q, k, v, arch)
    assert fused[:, 0].tolist() == [0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0]
    q2, k2, v2 = convert._unqkv(fused, arch)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_te_names_round_trip():
    arch, hf = _hf_state("qwen3")
    local = convert.hf_to_megatron(hf, arch, VOCAB)
    te = convert.to_te_names(local, arch)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert convert.from_te_names(te, arch).keys() == local.keys()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_megatron_model_matches_transformers(megatron_cpu, model_type):
    """Load converted weights into megatron-core's GPTModel: its response logprobs equal the
    transformers model's to fp32 rounding (1e-4 absolute on logprobs of magnitude ~5)."""
    from miles_core.config.schema import MilesConfig
    from miles_core.kernels.logprobs import logprobs_torch
    from miles_core.precision.base import PrecisionRecipe
    from miles_core.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    model = hf_model(model_type)
    arch = arch_from_hf(model.config.to_dict())
    trainer = MegatronTrainer(arch, model.state_dict(), MilesConfig(), torch.device("cpu"), PrecisionRecipe("fp32"), {"logprobs": logprobs_torch})
    b = batch()
    ref = hf_response_logprobs(model, b)
    got = trainer.compute_logprobs(b)
    assert ref.abs().max() > 1.0  # far from uniform (log 61 = 4.1), so the check has teeth
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # and the weights come back out unchanged, in HF names
    back = trainer.weights()
    hf = convert.split_fused_experts(dict(model.state_dict()))
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_the_trainer_s_architecture_of_a_loaded_model_is_its_checkpoint_s(tmp_path, model_type):
    """train.backend=megatron builds its architecture from the loaded model's config (arch_from_decoder): a Qwen3-MoE
    checkpoint came out as a dense qwen3 (no experts), and the trainer's weight conversion failed with a KeyError."""
    from miles_core.models.checkpoint import load_hf_folder
    from miles_core.plugins.manager import MilesPlugins
    from miles_core.train.megatron.arch import arch_from_decoder

    hf = hf_model(model_type)
    hf.save_pretrained(tmp_path)
    model, _family = load_hf_folder(tmp_path, MilesPlugins().registries.model_families)
    arch = arch_from_decoder(model.config)
    assert arch == arch_from_hf(hf.config.to_dict())
    if arch.is_moe:
        assert convert.hf_to_megatron(dict(model.state_dict()), arch, VOCAB, 1, 0)


def test_a_moe_model_with_dense_layers_is_refused_by_name():
    from miles_core.errors import ConfigError
    from miles_core.models.moe import MoeDecoderConfig
    from miles_core.train.megatron.arch import arch_from_decoder

    with pytest.raises(ConfigError, match="mlp_only_layers"):
        arch_from_decoder(MoeDecoderConfig(vocab_size=VOCAB, num_layers=2, mlp_only_layers=[1]))
