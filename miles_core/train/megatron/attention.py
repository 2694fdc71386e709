"""Megatron core attention through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materializes the [b, heads, s, s] scores and rejects
packed (THD) sequences; this module takes its place in the layer spec. It computes, per packed
sequence (boundaries from ``packed_seq_params.cu_seqlens_q``), causal softmax attention

    out = softmax(q k^T * scale + causal_mask) v

with grouped-query attention (``num_heads / num_query_groups`` query heads share a k/v head).
Shapes: THD ``q`` [t, heads, d], ``k``/``v`` [t, groups, d] -> [t, heads * d];
SBHD ``q`` [s, b, heads, d] -> [s, b, heads * d] (causal; right padding is then harmless).
On GPU SDPA dispatches to flash / memory-efficient kernels; on CPU to its math kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SDPACoreAttention(nn.Module):
    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, attention_type: str = "self",
                 softmax_scale: float | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        d = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [b, heads, s, d], k/v [b, groups, s, d]
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs) -> torch.Tensor:
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q.tolist()
            outs = []
            for start, end in zip(cu[:-1], cu[1:]):
                if end <= start:
                    continue
                q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                outs.append(self._attend(q, k, v)[0].transpose(0, 1))  # [len, heads, d]
            out = torch.cat(outs, dim=0)
            return out.reshape(out.shape[0], -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        out = self._attend(q, k, v)  # [b, h, s, d]
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
