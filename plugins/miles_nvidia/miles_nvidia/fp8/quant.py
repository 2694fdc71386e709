"""Blockwise e4m3 quantisation (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 3.3).

A tensor is cut into blocks along its last two dims; each block gets one fp32 scale
``s = amax(|block|) / 448`` (448 = the largest e4m3 value) and stores ``q = cast_e4m3(x / s)``, so
that ``x ~= q * s``. Activations use 1x128 tiles (one scale per row per 128 columns), weights
128x128 blocks. Scales are kept as dequantisation multipliers (what ``torch._scaled_mm`` takes and
what HF FP8 checkpoints call ``weight_scale_inv``). Shapes need not be multiples of the block:
edge blocks are padded with zeros for the statistic only.

Error bound: e4m3 has 3 mantissa bits, so ``|x - q s| <= 2^-4 |x|`` for values in e4m3's normal range
(relative half-ulp), plus ``s * 2^-10`` (half the smallest subnormal step) for tiny values.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128


def _blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, int, int]:
    m, k = x.shape
    pm, pk = (-m) % rows, (-k) % cols
    xp = torch.nn.functional.pad(x.float(), (0, pk, 0, pm))
    return xp.view((m + pm) // rows, rows, (k + pk) // cols, cols), m, k


def quantize_blockwise(x: torch.Tensor, rows: int, cols: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (``q`` [M, K] e4m3, ``scale`` [ceil(M/rows), ceil(K/cols)] fp32)."""
    xb, m, k = _blocks(x, rows, cols)
    amax = xb.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (xb / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.view(xb.shape[0] * rows, xb.shape[2] * cols)[:m, :k]
    return q.contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int = BLOCK, dtype=torch.float32) -> torch.Tensor:
    m, k = q.shape
    full = scale.repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k]
    return (q.float() * full).to(dtype)


def _quantize(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:  # one fused pass instead of ~6 torch passes
        from miles_nvidia.fp8.quant_triton import quantize_triton

        return quantize_triton(x, rows)
    return quantize_blockwise(x, rows)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles: ``scale`` [M, ceil(K/128)]."""
    return _quantize(x, 1)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks: ``scale`` [ceil(N/128), ceil(K/128)]."""
    return _quantize(w, BLOCK)
