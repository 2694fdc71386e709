"""Test-only: redirect megatron-core's CUDA assumptions to the CPU (CPU-only torch, no TE).

megatron-core creates tensors on ``torch.cuda.current_device()``, forks the CUDA RNG tracker
around dropout, and expects ``te_general_gemm`` and CUDA streams in places. None of that runs on
a CPU-only torch, so the fixture below (used by conftest.py) patches, for one test session:

* ``torch.cuda.current_device`` -> ``torch.device("cpu")`` (RoPE inv_freq, router and expert
  buffers, attention scratch tensors);
* the CUDA RNG tracker's ``fork`` -> a no-op context (dropout is 0 in these tests anyway);
* ``megatron.core.transformer.utils.get_default_causal_mask`` -> a CPU mask.

The production code never imports this module; on a GPU none of it is needed.
"""

from __future__ import annotations

import contextlib

import torch


def apply(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as tutils

    tracker = mrandom.get_cuda_rng_tracker()
    monkeypatch.setattr(tracker, "fork", lambda *a, **k: contextlib.nullcontext(), raising=False)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: tracker, raising=False)

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    monkeypatch.setattr(tutils, "get_default_causal_mask", causal_mask)
