"""One decoder-only transformer for both the rollout engine and the trainer.

Llama-style blocks (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU); with
``qk_norm`` it is Qwen3's dense block. Parameter names follow HF transformers
(``model.layers.0.self_attn.q_proj.weight``...), so HF safetensors load without renaming.

Because rollout and training run this same code, on CPU their logprobs agree to rounding; the
trainer and the engine differ only in how they batch (padding and the KV cache).

RMSNorm, rotary embedding and SwiGLU are the kernel ops "rmsnorm", "rope" and "swiglu": each
module calls the implementation it holds, the core's torch reference until
:meth:`Decoder.use_kernels` installs the ones the kernel registry chose for the platform (a
hardware plugin's fused Triton kernels on GPU). The trainer and the engine both call it, so they
run the same implementations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from miles_core.kernels.rmsnorm import rmsnorm_torch
from miles_core.kernels.rope import rope_torch
from miles_core.kernels.swiglu import swiglu_torch
from miles_core.models import rope


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None = hidden_size // num_heads
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's RoPE scaling parameters (miles_core.models.rope), None = plain RoPE
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False  # Qwen3
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.op = rmsnorm_torch  # kernel op "rmsnorm" (see Decoder.use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the reference op). ``x`` [B, heads, T, D]; ``cos``/``sin`` [B, 1, T, D]."""
    return rope_torch(x, cos, sin)


class KVCache:
    """A contiguous per-layer cache, [B, kv_heads, max_len, D], filled left to right."""

    def __init__(self, cfg: DecoderConfig, batch: int, max_len: int, device, dtype) -> None:
        shape = (batch, cfg.num_kv_heads, max_len, cfg.dim_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.length = 0  # slots written so far (the same for every row)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        self.k[layer][:, :, self.length : self.length + t] = k
        self.v[layer][:, :, self.length : self.length + t] = v
        end = self.length + t
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        d = cfg.dim_head
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rope = rope_torch  # kernel op "rope"

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.cfg.dim_head
        q = self.q_proj(x).view(b, t, -1, d)
        k = self.k_proj(x).view(b, t, -1, d)
        v = self.v_proj(x).view(b, t, -1, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, k, v)
        rep = self.cfg.num_heads // self.cfg.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif callable(mask):  # packed sequences: an AttentionFn (miles_core.train.packing)
            out = mask(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = swiglu_torch  # kernel op "swiglu": silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope.inv_freq(cfg.dim_head, cfg.rope_theta, cfg.rope_scaling), persistent=False)
        self.apply(self._init)

    def use_kernels(self, kernels) -> Decoder:
        """Install the kernel registry's "rmsnorm", "rope" and "swiglu" in every module (in place).

        ``kernels`` is a :class:`~miles_core.kernels.base.Kernels` (or any mapping of op name to
        function); an op it lacks keeps the module's current implementation."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.op = kernels.get("rmsnorm", m.op)
            elif isinstance(m, Attention):
                m.rope = kernels.get("rope", m.rope)
            elif isinstance(m, MLP):
                m.act = kernels.get("swiglu", m.act)
        return self

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)``, ``.half()``... cast the weights, not the rotary frequencies: they stay fp32, as transformers
        keeps them in a bf16 model and the trainer's fp32 master copy has them (in bf16 they are off by up to 0.4%, the
        rotary angles at position 4096 by nearly 2 rad). Recomputed from the config, so also from a meta tensor."""
        out = super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            cfg = self.config
            self.inv_freq = rope.inv_freq(cfg.dim_head, cfg.rope_theta, cfg.rope_scaling).to(self.inv_freq.device)
        return out

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, T, H] (apply :attr:`lm_head` for logits).

        Without ``attn_mask`` attention is causal over the given tokens (right padding is safe).
        With a cache, ``attn_mask`` is a bool [B, 1, T, cache_len + T] (True = attend).
        ``attn_mask`` may also be a callable ``(q, k, v) -> out`` on [B, heads, T, D] tensors: the
        trainer passes one for packed sequences (attention restricted to each sample).
        """
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attn_mask, cache, i)
        if cache is not None:
            cache.length += t
        return self.model.norm(x)
