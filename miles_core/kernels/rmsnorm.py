"""Reference op "rmsnorm": ``y = weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)``.

Zhang & Sennrich 2019, "Root Mean Square Layer Normalization". ``x`` [..., H], ``weight`` [H].
The statistic is taken in fp32; the normalised value is rounded to ``x.dtype`` before the
weight multiplies it (as HF Llama/Qwen3 do), so the output dtype is ``promote(weight, x)``.
"""

from __future__ import annotations

import torch


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
