"""Tiny random models: HF models of each family, saved to a folder and loaded back by Miles, and a
random Miles decoder (``tiny``) with weights large enough that its greedy choices are not near ties."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def hf_config(family: str, head_dim: int = 8, rope_parameters: dict | None = None):
    """``head_dim`` 16 (or any multiple of 16) lets the CPU decode window's fused kernels (cpu_native.c) run.
    ``rope_parameters``: a scaled RoPE (Llama only), HF's dict without ``rope_theta``."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=head_dim, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "llama":
        rope = {"rope_parameters": {"rope_theta": 10000.0, **rope_parameters}} if rope_parameters else {"rope_theta": 10000.0}
        return LlamaConfig(intermediate_size=64, tie_word_embeddings=True, **rope, **common)
    if family == "qwen3":
        return Qwen3Config(intermediate_size=64, tie_word_embeddings=False, rope_theta=1000000.0, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=True, tie_word_embeddings=False, **common)
    raise ValueError(family)


def make_hf_model(family: str, path: Path, seed: int = 0, head_dim: int = 8):
    """A random fp32 HF model of ``family`` saved under ``path``; returns the HF module (eval)."""
    return save_random_hf(hf_config(family, head_dim), path, seed)


def save_random_hf(config, path: Path, seed: int = 0):
    """A random fp32 transformers model of ``config`` saved under ``path``; returns it (eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than the default init, so greedy paths are not all one token
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return model


def load_miles(path: Path):
    from miles_core.models.checkpoint import load_hf_folder
    from miles_core.plugins.manager import MilesPlugins

    model, _family = load_hf_folder(path, MilesPlugins().registries.model_families)
    return model.eval()


def tiny(seed: int = 0, vocab: int = 80, head_dim: int | None = None):
    """head_dim None: 8 (hidden 32 / 4 heads); 16 lets the CPU decode window's fused kernels run."""
    from miles_core.models.decoder import Decoder, DecoderConfig

    torch.manual_seed(seed)
    m = Decoder(DecoderConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                              head_dim=head_dim))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return m.eval()
