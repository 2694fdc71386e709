"""FP8 weight export for rollout engines: 128x128 block-scaled e4m3 with inverse scales.

The layout is the one HF FP8 checkpoints (DeepSeek-V3, Qwen3-FP8) and SGLang read: each
quantised ``<name>.weight`` [N, K] is stored in e4m3 beside ``<name>.weight_scale_inv``
[ceil(N/128), ceil(K/128)] fp32, with ``W ~= weight * weight_scale_inv`` blockwise (the "inv"
is the dequantisation multiplier, i.e. the inverse of the quantisation scale). The config entry is
:data:`QUANT_CONFIG`. Embeddings, norms and the LM head stay in their own dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles_nvidia.fp8.quant import BLOCK, dequantize_blockwise, quantize_weight

QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
SUFFIX = "_scale_inv"


def _quantised(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("proj.weight") and "lm_head" not in name


def export_fp8(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if _quantised(name, t):
            q, s = quantize_weight(t)
            out[name], out[name + SUFFIX] = q, s
        else:
            out[name] = t
    return out


def dequantize_fp8(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The inverse of :func:`export_fp8`, for an engine that computes in ``dtype``."""
    out = {}
    for name, t in state_dict.items():
        if name.endswith(SUFFIX):
            continue
        scale = state_dict.get(name + SUFFIX)
        out[name] = t if scale is None else dequantize_blockwise(t, scale, BLOCK, BLOCK, dtype)
    return out
