"""Masked reductions shared by the estimators and losses. ``x``, ``mask`` are [N, T]."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance over the tokens where ``mask`` is one."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked tokens of the whole batch; zero on padding.

    Computed in float64: there the sum of up to 2**29 equal float32 values is exact, so a batch whose
    values are all equal (returns of 0.1 everywhere, say) has std 0 and whitens to exactly 0. In float32
    the mean is off by rounding and the std is that rounding (~1e-8), which ``eps`` does not dominate:
    such a batch came out as +-0.4 on every token."""
    xd, md = x.double(), mask.double()
    mean = masked_mean(xd, md)
    std = masked_var(xd, md).sqrt()
    out = (xd - mean) if shift_mean else xd
    return (out / (std + eps) * md).to(x.dtype)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N]: per-sequence mean over its masked tokens (0 for an empty sequence)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[N]: index of the last position where ``mask`` is one (0 for an empty row)."""
    t = torch.arange(mask.shape[1], device=mask.device)
    return ((mask > 0) * (t + 1)).amax(-1).sub(1).clamp(min=0)
