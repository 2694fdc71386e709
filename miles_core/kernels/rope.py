"""Reference op "rope": rotate-half rotary embedding (Su et al. 2021, "RoFormer").

``x`` [B, heads, T, D]; ``cos``/``sin`` [B, 1, T, D] (the two halves of the last dim repeat the
same D/2 frequencies). With x = (x1, x2) split in halves: ``out = x * cos + (-x2, x1) * sin``.
"""

from __future__ import annotations

import torch


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
