"""Tiny models for the transport tests."""

import torch


def tiny_model(seed: int, tie: bool = True):
    """A tiny char-level decoder with weights wide enough that greedy outputs depend on them."""
    from miles_core.data.tokenizer import CharTokenizer
    from miles_core.models.decoder import Decoder, DecoderConfig

    torch.manual_seed(seed)
    tok = CharTokenizer()
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                  intermediate_size=64, tie_word_embeddings=tie))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model, tok


def save(model, tok, path):
    from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.plugins.manager import MilesPlugins

    save_hf_folder(model, MilesPlugins(autoload=False).registries.model_families.get("llama"), path, {CHAR_TOKENIZER_FILE: tok.to_json()})
    return path
