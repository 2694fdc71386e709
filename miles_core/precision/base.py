"""Precision recipes: the dtype weights are kept in, and the autocast used for compute."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionRecipe:
    name: str
    param_dtype: torch.dtype = torch.float32  # master weights
    compute_dtype: torch.dtype | None = None  # autocast dtype; None = no autocast

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.param_dtype)
