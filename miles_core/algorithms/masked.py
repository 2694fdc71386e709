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
    """(x - mean) / std over the masked tokens of the whole batch; zero on padding."""
    mean = masked_mean(x, mask)
    std = masked_var(x, mask).sqrt()
    out = (x - mean) if shift_mean else x
    return out / (std + eps) * mask


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N]: per-sequence mean over its masked tokens (0 for an empty sequence)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[N]: index of the last position where ``mask`` is one (0 for an empty row)."""
    t = torch.arange(mask.shape[1], device=mask.device)
    return ((mask > 0) * (t + 1)).amax(-1).sub(1).clamp(min=0)
