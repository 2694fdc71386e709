"""Qwen3-MoE: the shared decoder with its MLPs replaced by a sparse mixture of experts.

Routing (Qwen3-MoE, as in HF ``Qwen3MoeSparseMoeBlock``)::

    p   = softmax(x @ W_gate^T)            # [N, E], in float32
    w,i = topk(p, k)                       # [N, k] weights and expert ids
    w   = w / sum(w)  if norm_topk_prob    # renormalise over the chosen k
    y   = sum_j w_j * Expert_{i_j}(x)      # each expert a SwiGLU MLP of width moe_intermediate_size

Parameter names follow the HF checkpoint on disk (``mlp.gate.weight``,
``mlp.experts.{e}.{gate,up,down}_proj.weight``), so folders saved by transformers load as they are.
:meth:`SparseMoe.route` exposes the chosen experts so the rollout engine can record them per token
and layer (routing replay, R3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from miles_core.models.base import ModelFamily
from miles_core.models.decoder import MLP, Decoder, DecoderConfig


@dataclass
class MoeDecoderConfig(DecoderConfig):
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0


class SparseMoe(nn.Module):
    def __init__(self, cfg: MoeDecoderConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        expert_cfg = DecoderConfig(vocab_size=1, hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size)
        self.experts = nn.ModuleList(MLP(expert_cfg) for _ in range(cfg.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [N, H] -> (expert ids [N, k] int64, weights [N, k] in x's dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def combine(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Run each token through its chosen experts. ``x`` [N, H] -> [N, H]."""
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one host sync per layer
        token = order // self.top_k
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            rows = token[start : start + n]
            y = self.experts[e](x[rows]) * weights.flatten()[sel, None]
            out.index_add_(0, rows, y)
            start += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.route(flat)
        return self.combine(flat, ids, weights).reshape(shape)


def split_fused_experts(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 keeps Qwen3-MoE experts fused in memory (``experts.gate_up_proj``
    [E, 2I, H], ``experts.down_proj`` [E, H, I]); return the per-expert checkpoint layout."""
    out = {}
    for name, t in hf.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for j in range(t.shape[0]):
                gate, up = t[j].chunk(2, dim=0)
                out[f"{base}{j}.gate_proj.weight"] = gate
                out[f"{base}{j}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for j in range(t.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = t[j]
        else:
            out[name] = t
    return out


class MoeDecoder(Decoder):
    """:class:`Decoder` whose sparse layers use :class:`SparseMoe` in place of the dense MLP.

    A plain :class:`DecoderConfig` (``model.family=qwen3_moe`` built from the ``model.*`` fields, no checkpoint)
    gets :class:`MoeDecoderConfig`'s default expert fields."""

    def __init__(self, cfg: DecoderConfig) -> None:
        if not isinstance(cfg, MoeDecoderConfig):
            cfg = MoeDecoderConfig(**vars(cfg))
        super().__init__(cfg)
        for i, layer in enumerate(self.model.layers):
            if cfg.is_sparse(i):
                layer.mlp = SparseMoe(cfg)
        self.apply(self._init)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class MoeFamily(ModelFamily):
    """The Qwen3-MoE model family: the dense fields of :class:`ModelFamily` plus the expert fields."""

    def config_from_hf(self, hf: dict[str, Any]) -> MoeDecoderConfig:
        """A field that config.json lacks takes transformers' ``Qwen3MoeConfig`` default (``num_experts_per_tok`` 8),
        so that the checkpoint computes what transformers computes."""
        dense = super().config_from_hf(hf)
        return MoeDecoderConfig(
            **vars(dense),
            num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 8),
            moe_intermediate_size=int(hf.get("moe_intermediate_size", dense.intermediate_size)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
        )

    def config_to_hf(self, cfg: MoeDecoderConfig) -> dict[str, Any]:
        return {
            **super().config_to_hf(cfg),
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers),
        }
