"""Reference op "swiglu": ``silu(gate) * up`` (Shazeer 2020, "GLU Variants Improve Transformer").

``gate``, ``up`` [..., I] of one dtype; returns the same shape and dtype. silu(g) = g * sigmoid(g).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
