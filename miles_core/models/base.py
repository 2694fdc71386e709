"""Model families: how to build a policy from an HF-style config, and its checkpoint layout."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from miles_core.models import rope
from miles_core.models.decoder import DecoderConfig


@dataclass(frozen=True)
class ModelFamily:
    name: str
    hf_model_types: tuple[str, ...]  # HF config "model_type" values this family loads
    architecture: str  # HF "architectures" entry written on export
    qk_norm: bool
    build: Callable[[DecoderConfig], nn.Module]

    def unsupported(self, hf: dict[str, Any]) -> str | None:
        """What in the HF config ``hf`` this family's implementation does not do (so that it would compute
        another function than transformers), or None if it runs the checkpoint as it is."""
        reasons = [rope.unsupported(rope.scaling_from_hf(hf))]
        act = hf.get("hidden_act", "silu")
        reasons.append(None if act in ("silu", "swish") else f"activation '{act}' (Miles' MLP is SwiGLU)")
        reasons.append("attention biases (attention_bias)" if hf.get("attention_bias") else None)
        reasons.append("MLP biases (mlp_bias)" if hf.get("mlp_bias") else None)
        sliding = hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or [])
        reasons.append("sliding-window attention" if sliding else None)
        return "; ".join(r for r in reasons if r) or None

    def config_from_hf(self, hf: dict[str, Any]) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            intermediate_size=hf["intermediate_size"],
            rope_theta=rope.theta_from_hf(hf),
            rope_scaling=rope.scaling_from_hf(hf),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=self.qk_norm,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        )

    def config_to_hf(self, cfg: DecoderConfig) -> dict[str, Any]:
        scaling = {"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {}
        return {
            "architectures": [self.architecture],
            "model_type": self.hf_model_types[0],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.dim_head,
            "intermediate_size": cfg.intermediate_size,
            "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.rms_norm_eps,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "max_position_embeddings": cfg.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": "float32",
            **scaling,
        }
