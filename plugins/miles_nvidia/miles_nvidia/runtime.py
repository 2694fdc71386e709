"""Where Triton kernels may run: on CUDA tensors, or anywhere under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_ok(*tensors: torch.Tensor) -> bool:
    """True if a Triton kernel can take these tensors (CUDA, or CPU under the interpreter)."""
    if interpreting():
        return True
    return all(t.is_cuda for t in tensors)
