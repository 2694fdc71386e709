"""HF <-> megatron-core weight conversion for Llama, Qwen3 and Qwen3-MoE (plain torch, no megatron import).

Megatron names below are those of the local layer spec; :func:`to_te_names` / :func:`from_te_names`
map the two that TransformerEngine's spec fuses into its linears.

| HF | Megatron | layout |
| --- | --- | --- |
| model.embed_tokens.weight [V, H] | embedding.word_embeddings.weight [Vp/tp, H] | vocab rows, padded to Vp, split over TP |
| lm_head.weight (untied only) | output_layer.weight [Vp/tp, H] | same |
| model.norm.weight | decoder.final_layernorm.weight | replicated |
| layers.i.input_layernorm | decoder.layers.i.input_layernorm | replicated |
| q_proj [nq*d, H], k_proj, v_proj [nkv*d, H] | self_attention.linear_qkv.weight [(nq+2nkv)*d/tp, H] | per KV group g: its rep = nq/nkv query heads, then k_g, then v_g; groups split over TP |
| self_attn.q_norm / k_norm [d] | self_attention.q_layernorm / k_layernorm | replicated |
| o_proj [H, nq*d] | self_attention.linear_proj.weight [H, nq*d/tp] | columns split over TP |
| post_attention_layernorm | pre_mlp_layernorm | replicated |
| gate_proj, up_proj [I, H] | mlp.linear_fc1.weight [2I/tp, H] | per TP rank: [gate shard; up shard] |
| down_proj [H, I] | mlp.linear_fc2.weight [H, I/tp] | columns split over TP |
| mlp.gate.weight [E, H] (MoE router) | mlp.router.weight | replicated |
| mlp.experts.j.{gate,up,down}_proj | mlp.experts.local_experts.j.linear_fc{1,2} | as the dense MLP, per expert; experts split over EP |

Tied embeddings: only ``embedding.word_embeddings.weight`` exists on the Megatron side; on the
way back ``lm_head.weight`` is left out (HF ties it), as in :func:`miles_core.models.checkpoint.save_hf_folder`.
"""

from __future__ import annotations

import re

import torch

from miles_core.errors import ConfigError
from miles_core.models.moe import split_fused_experts
from miles_core.train.megatron.arch import Arch

_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _vocab_shard(w: torch.Tensor, vocab_padded: int, tp: int, rank: int) -> torch.Tensor:
    if vocab_padded > w.shape[0]:
        w = torch.cat([w, w.new_zeros(vocab_padded - w.shape[0], w.shape[1])])
    return w.chunk(tp, dim=0)[rank]


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Arch) -> torch.Tensor:
    d, g, h = arch.head_dim, arch.num_kv_heads, arch.hidden_size
    rep = arch.num_heads // g
    return torch.cat([q.reshape(g, rep * d, h), k.reshape(g, d, h), v.reshape(g, d, h)], dim=1).reshape(-1, h)


def _unqkv(w: torch.Tensor, arch: Arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, g, h = arch.head_dim, arch.num_kv_heads, arch.hidden_size
    rep = arch.num_heads // g
    w = w.reshape(g, (rep + 2) * d, h)
    q, k, v = w.split([rep * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def _fc1(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])


def hf_to_megatron(
    hf: dict[str, torch.Tensor], arch: Arch, vocab_padded: int, tp: int = 1, tp_rank: int = 0, ep: int = 1, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """The Megatron (local-spec) state dict of TP rank ``tp_rank`` / EP rank ``ep_rank``."""
    if arch.num_kv_heads % tp or arch.num_heads % tp:
        raise ConfigError(f"train.megatron.tensor_parallel={tp} must divide the heads ({arch.num_heads}) and KV heads ({arch.num_kv_heads})")
    if arch.is_moe and arch.num_experts % ep:
        raise ConfigError(f"train.megatron.expert_parallel={ep} must divide the number of experts ({arch.num_experts})")
    hf = split_fused_experts(hf)
    try:
        out = {"embedding.word_embeddings.weight": _vocab_shard(hf["model.embed_tokens.weight"], vocab_padded, tp, tp_rank)}
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = _vocab_shard(hf["lm_head.weight"], vocab_padded, tp, tp_rank)
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        for i in range(arch.num_layers):
            p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            a = p + "self_attn."
            out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
            qkv = _qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], arch)
            out[m + "self_attention.linear_qkv.weight"] = qkv.chunk(tp, dim=0)[tp_rank]
            out[m + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"].chunk(tp, dim=1)[tp_rank]
            if arch.qk_norm:
                out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
                out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
            out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
            if arch.is_moe:
                out[m + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
                per_rank = arch.num_experts // ep
                for j in range(per_rank):
                    e = f"{p}mlp.experts.{ep_rank * per_rank + j}."
                    le = f"{m}mlp.experts.local_experts.{j}."
                    out[le + "linear_fc1.weight"] = _fc1(hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"], tp, tp_rank)
                    out[le + "linear_fc2.weight"] = hf[e + "down_proj.weight"].chunk(tp, dim=1)[tp_rank]
            else:
                out[m + "mlp.linear_fc1.weight"] = _fc1(hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"], tp, tp_rank)
                out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[tp_rank]
    except KeyError as exc:
        raise ConfigError(f"the HF weights lack {exc.args[0]!r}, which a {arch.model_type} model with this config needs") from None
    return {k: v.contiguous() for k, v in out.items()}


def globalize_experts(state: dict[str, torch.Tensor], ep_rank: int, experts_per_rank: int) -> dict[str, torch.Tensor]:
    """Rename ``local_experts.j`` to the global expert index ``ep_rank * experts_per_rank + j``."""
    out = {}
    for k, v in state.items():
        m = _EXPERT.match(k)
        out[f"{m[1]}{ep_rank * experts_per_rank + int(m[2])}{m[3]}" if m else k] = v
    return out


def megatron_to_hf(tp_shards: list[dict[str, torch.Tensor]], arch: Arch) -> dict[str, torch.Tensor]:
    """HF state dict from the local-spec state dicts of every TP rank (in rank order), whose
    expert names carry global indices (:func:`globalize_experts`). Padded vocab rows are dropped."""
    tp = len(tp_shards)

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in tp_shards], dim=dim)

    def unfc1(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [s[name].chunk(2, dim=0) for s in tp_shards]
        return torch.cat([g for g, _ in parts]), torch.cat([u for _, u in parts])

    first = tp_shards[0]
    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[: arch.vocab_size]}
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[: arch.vocab_size]
    out["model.norm.weight"] = first["decoder.final_layernorm.weight"]
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = first[m + "input_layernorm.weight"]
        q, k, v = _unqkv(cat(m + "self_attention.linear_qkv.weight", 0), arch)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        out[a + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        if arch.qk_norm:
            out[a + "q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"]
            out[a + "k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
        if arch.is_moe:
            out[p + "mlp.gate.weight"] = first[m + "mlp.router.weight"]
            for j in range(arch.num_experts):
                le, e = f"{m}mlp.experts.local_experts.{j}.", f"{p}mlp.experts.{j}."
                out[e + "gate_proj.weight"], out[e + "up_proj.weight"] = unfc1(le + "linear_fc1.weight")
                out[e + "down_proj.weight"] = cat(le + "linear_fc2.weight", 1)
        else:
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = unfc1(m + "mlp.linear_fc1.weight")
            out[p + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
    return {k: v.contiguous() for k, v in out.items()}


_TE = (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
       ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))


def to_te_names(state: dict[str, torch.Tensor], arch: Arch) -> dict[str, torch.Tensor]:
    """TransformerEngine's spec fuses the pre-attention norm into linear_qkv and (dense only)
    the pre-MLP norm into linear_fc1."""
    pairs = _TE[:1] if arch.is_moe else _TE
    out = {}
    for k, v in state.items():
        for local, te in pairs:
            if k.startswith("decoder.layers.") and k.endswith("." + local):
                k = k[: -len(local)] + te
        out[k] = v
    return out


def from_te_names(state: dict[str, torch.Tensor], arch: Arch) -> dict[str, torch.Tensor]:
    pairs = _TE[:1] if arch.is_moe else _TE
    out = {}
    for k, v in state.items():
        if k.endswith("_extra_state"):
            continue
        for local, te in pairs:
            if k.startswith("decoder.layers.") and k.endswith("." + te):
                k = k[: -len(te)] + local
        out[k] = v
    return out
