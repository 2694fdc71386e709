"""Per-step statistics of the advantages (logged as ``adv_*``). ``adv``, ``mask`` are [N, T]."""

from __future__ import annotations

import torch

from miles_core.algorithms.masked import masked_mean, masked_var


def advantage_metrics(adv: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    valid = adv[mask > 0]
    if valid.numel() == 0:
        return {"adv_mean": 0.0, "adv_std": 0.0, "adv_min": 0.0, "adv_max": 0.0, "adv_zero_frac": 1.0}
    return {
        "adv_mean": float(masked_mean(adv, mask)),
        "adv_std": float(masked_var(adv, mask).sqrt()),
        "adv_min": float(valid.min()),
        "adv_max": float(valid.max()),
        "adv_zero_frac": float((valid == 0).float().mean()),
    }
