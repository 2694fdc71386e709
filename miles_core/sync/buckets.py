from __future__ import annotations

from collections.abc import Mapping

import torch


def buckets(weights: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most ``bucket_bytes`` each (a larger tensor gets its own)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        out.append(cur)
    return out


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
