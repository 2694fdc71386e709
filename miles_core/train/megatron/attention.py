"""Megatron core attention through Miles' packed attention (:class:`~miles_core.train.packing.SegmentAttention`).

Megatron's local ``DotProductAttention`` materializes the [b, heads, s, s] scores and rejects
packed (THD) sequences; :class:`SDPACoreAttention` takes its place in the layer spec. It computes,
within each packed sequence, causal softmax attention

    out = softmax(q k^T * scale + causal_mask) v

with grouped-query attention (``num_heads / num_query_groups`` query heads share a k/v head).
Shapes: THD ``q`` [t, heads, d], ``k``/``v`` [t, groups, d] -> [t, heads * d];
SBHD ``q`` [s, b, heads, d] -> [s, b, heads * d] (causal; right padding is then harmless).

A pack goes through the same ``SegmentAttention`` as the torch trainer, so ``train.attention``
(auto | sdpa | padded | varlen | cudnn) picks the kernel for both trainers. The trainer builds it
once per micro-batch and hands it over in :class:`PackedSegments` (Megatron's ``PackedSeqParams``
plus that object), so no layer reads the sequence boundaries back from the GPU. With the local
spec the trainer declares the pack as SBHD with batch 1 and gives RoPE one frequency row per token
(each sample's positions from 0): Megatron's THD RoPE would read the boundaries with ``.tolist()``
in every layer, a graph break under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import nn

from miles_core.train.packing import SegmentAttention


@dataclasses.dataclass
class PackedSegments(PackedSeqParams):
    """``PackedSeqParams`` that also carries the micro-batch's attention over the pack."""

    segments: SegmentAttention | None = None


class SDPACoreAttention(nn.Module):
    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, attention_type: str = "self",
                 softmax_scale: float | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        d = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs) -> torch.Tensor:
        rep = query.shape[-2] // key.shape[-2]
        if rep > 1:  # [.., groups, d] -> [.., heads, d], query head h reads k/v group h // rep
            key, value = key.repeat_interleave(rep, dim=-2), value.repeat_interleave(rep, dim=-2)
        segments = getattr(packed_seq_params, "segments", None)
        if segments is None and packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            segments = SegmentAttention(packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q, "sdpa")
        if segments is not None:  # a pack: THD [t, h, d], or SBHD with b = 1 [t, 1, h, d]
            sbhd = query.dim() == 4
            if sbhd:
                query, key, value = query[:, 0], key[:, 0], value[:, 0]
            q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, heads, t, d]
            if self.scale != 1.0 / math.sqrt(query.shape[-1]):
                q = q * (self.scale * math.sqrt(query.shape[-1]))  # SegmentAttention uses SDPA's default scale
            out = segments(q, k, v)[0].transpose(0, 1).reshape(query.shape[0], -1)  # [t, heads * d]
            return out[:, None] if sbhd else out
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
