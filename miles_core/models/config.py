from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError


@dataclass
class ModelConfig:
    """The policy. ``hf_checkpoint`` loads an HF safetensors folder; otherwise a model is built
    from the fields below (the tiny quickstart model), with a character tokenizer."""

    hf_checkpoint: str | None = None  # (--hf-checkpoint)
    family: str = "llama"  # a registered model family (llama, qwen3)
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_seq_len: int = 256

    def validate(self) -> None:
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if not self.rope_theta > 0:  # 0 gives inf rotary frequencies, a negative base nan ones: every logit nan
            raise ConfigError(f"model.rope_theta must be > 0, got {self.rope_theta}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads ({self.num_kv_heads})")
