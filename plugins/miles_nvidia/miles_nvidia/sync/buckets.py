"""Pack a state dict into a few flat buffers (one dtype each, at most ``bucket_bytes``) and back.

Shipping a few large buffers instead of hundreds of small tensors is what makes a broadcast or an
IPC hand-off fast: one collective / one handle per bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the bucket's dtype
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    dtype: torch.dtype
    numel: int
    entries: tuple[Entry, ...]


def plan_buckets(metas: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[BucketPlan]:
    """Group tensors by dtype in state-dict order; a tensor larger than a bucket gets its own."""
    plans: list[BucketPlan] = []
    open_: dict[torch.dtype, list[Entry]] = {}
    sizes: dict[torch.dtype, int] = {}

    def close(dt):
        if open_.get(dt):
            plans.append(BucketPlan(dt, sizes[dt], tuple(open_[dt])))
        open_[dt], sizes[dt] = [], 0

    for name, shape, dt in metas:
        numel = 1
        for d in shape:
            numel *= d
        if dt in sizes and sizes[dt] and (sizes[dt] + numel) * dt.itemsize > bucket_bytes:
            close(dt)
        open_.setdefault(dt, [])
        sizes.setdefault(dt, 0)
        open_[dt].append(Entry(name, tuple(shape), sizes[dt], numel))
        sizes[dt] += numel
    for dt in list(open_):
        close(dt)
    return plans


def metas_of(weights: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(k, tuple(v.shape), v.dtype) for k, v in weights.items()]


def pack(weights: Mapping[str, torch.Tensor], plan: BucketPlan, device) -> torch.Tensor:
    buf = torch.empty(plan.numel, dtype=plan.dtype, device=device)
    for e in plan.entries:
        buf[e.offset : e.offset + e.numel].copy_(weights[e.name].reshape(-1))
    return buf


def unpack(buf: torch.Tensor, plan: BucketPlan) -> dict[str, torch.Tensor]:
    """Views into ``buf`` (copy them out before ``buf`` is reused)."""
    return {e.name: buf[e.offset : e.offset + e.numel].view(e.shape) for e in plan.entries}
