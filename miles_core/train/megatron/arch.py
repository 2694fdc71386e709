"""The architecture a Megatron model is built from, read from an HF config (Llama, Qwen3, Qwen3-MoE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_core.errors import ConfigError
from miles_core.models import rope
from miles_core.models.decoder import DecoderConfig
from miles_core.models.moe import MoeDecoderConfig

SUPPORTED = ("llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Arch:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (unused by an all-MoE model)
    rope_theta: float
    rms_norm_eps: float
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_experts: int = 0  # 0 = dense
    moe_intermediate_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def arch_from_hf(hf: dict[str, Any]) -> Arch:
    """``hf`` is an HF ``config.json`` as a dict."""
    model_type = hf.get("model_type", "")
    if model_type not in SUPPORTED:
        raise ConfigError(f"the Megatron trainer converts model_type {', '.join(SUPPORTED)}; got '{model_type}'")
    _plain_rope_only(rope.scaling_from_hf(hf))
    heads = hf["num_attention_heads"]
    moe = model_type == "qwen3_moe"
    if moe and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
        raise ConfigError("qwen3_moe checkpoints with dense layers (mlp_only_layers / decoder_sparse_step) are not supported by the Megatron trainer")
    return Arch(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf.get("intermediate_size", 0),
        rope_theta=rope.theta_from_hf(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        num_experts=(hf.get("num_experts") or hf.get("num_local_experts") or 0) if moe else 0,
        moe_intermediate_size=hf.get("moe_intermediate_size", 0) if moe else 0,
        moe_topk=hf.get("num_experts_per_tok", 0) if moe else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
    )


def arch_from_decoder(cfg: DecoderConfig) -> Arch:
    """The architecture of Miles' own :class:`~miles_core.models.decoder.Decoder`, or of a
    :class:`~miles_core.models.moe.MoeDecoder` (its expert fields; the trainer builds from a loaded model's config,
    so without them a Qwen3-MoE checkpoint came out dense)."""
    _plain_rope_only(cfg.rope_scaling)
    model_type, moe = ("qwen3" if cfg.qk_norm else "llama"), {}
    if isinstance(cfg, MoeDecoderConfig):
        if cfg.mlp_only_layers or cfg.decoder_sparse_step != 1:
            raise ConfigError("qwen3_moe checkpoints with dense layers (mlp_only_layers / decoder_sparse_step) are not supported by the Megatron trainer")
        model_type, moe = "qwen3_moe", dict(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                                             moe_topk=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob)
    return Arch(
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.dim_head,
        intermediate_size=cfg.intermediate_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        qk_norm=cfg.qk_norm,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        **moe,
    )


def _plain_rope_only(scaling: dict | None) -> None:
    if scaling is not None:
        raise ConfigError(f"the Megatron trainer builds plain RoPE; this model scales it ({scaling['rope_type']}): "
                          "use train.backend=torch")
