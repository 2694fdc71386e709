"""torch's flash-attention varlen op with causal masking, where this torch has it (>= 2.10, CUDA).

Causal attention within each of several sequences packed into one flat [N, heads, D] batch, the
sequences given by ``cu_seqlens`` [B + 1] int32 (their start offsets, then N). The trainer uses it
for packed micro-batches (``train.attention=varlen``) and the engine for prefills that start at
position 0. Query and key lengths are the same here (no cached prefix): the causal mask is then
the same whether the library aligns it top-left or bottom-right.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch


def causal_varlen() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """``fn(q, k, v, cu_seqlens, max_seqlen) -> out`` (all [N, heads, D]), or None without the op."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:  # torch 2.10 / 2.11
        return lambda q, k, v, cu, m: varlen_attn(q, k, v, cu, cu, m, m, is_causal=True)
    if "window_size" in params:  # torch >= 2.12
        return lambda q, k, v, cu, m: varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))
    return None
