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
    # True: the built-in engine runs every step inside kernel_mode with exact attention (decode through
    # the trainer's scaled_dot_product_attention call, no CUDA graphs), so that rollout and training
    # logprobs can be bitwise equal (a plugin's batch-invariant mode)
    batch_invariant: bool = False

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def kernel_mode(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Entered around every forward of the trainer and the built-in engine (model and logprob op).

        The core's recipes use none; a plugin's recipe may swap kernels here (e.g. a TorchFunctionMode)."""
        return contextlib.nullcontext()

    def unavailable(self, device: torch.device) -> str | None:
        """Why this recipe cannot run on ``device`` (e.g. a GPU too old for its kernels), or None. Checked as the
        run starts, so that the config is refused there and not at the first step. The core's recipes run anywhere."""
        return None

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.param_dtype)
