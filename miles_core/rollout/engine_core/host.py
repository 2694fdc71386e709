"""Host <-> device transfers that do not wait for the device.

A plain ``torch.tensor(data, device="cuda")`` (or any blocking host-to-device copy) synchronizes the
stream: the host waits until every kernel already enqueued has run. In the engine's loop that wait
sat in each decode window's launch (its page tables), so the host could not enqueue window N+1
while window N ran, and the GPU idled while it did (docs/benchmarks.md, session 13). Here host data
goes through pinned memory with an asynchronous copy, ordered on the stream like a kernel; PyTorch's
caching host allocator keeps each pinned buffer until its copy has run. Device results come back the
same way, behind an event the caller waits on.
"""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``, enqueued without a stream sync."""
    t = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t if device.type == "cpu" else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors -> host copies without waiting (pinned buffers, async copies); CPU tensors as they are.
    The copies are valid once an event recorded after them has fired."""
    out = []
    for t in ts:
        if t.device.type == "cpu":
            out.append(t)
            continue
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        out.append(h)
    return out
