"""GPU checks (skipped without CUDA): packed varlen attention and the logprob op's real memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from miles_core.kernels.varlen import causal_varlen
from miles_core.train.packing import SegmentAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.gpu
def test_varlen_attention_matches_per_sample_sdpa():
    if causal_varlen() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    cu = torch.tensor([0, 100, 356, 400], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, 8, 400, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = SegmentAttention(cu, 256, impl="sdpa")(q, k, v)
    got = SegmentAttention(cu, 256, impl="varlen")(q, k, v)
    assert (got.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bounds", [[0, 100, 356, 400], [0, 400]])
def test_cudnn_attention_matches_per_sample_sdpa(bounds):
    """train.attention=cudnn (the padded batch through SDPA's cuDNN backend, the only backend it
    allows: where cuDNN cannot run, SDPA raises instead of using another kernel): values and grads."""
    torch.manual_seed(0)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1, 8, 400, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    ref = SegmentAttention(cu, 400, impl="sdpa")(q, k, v)
    got = SegmentAttention(cu, 400, impl="cudnn")(q, k, v)
    assert (got.float() - ref.float()).abs().max() < 2e-2
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), g)
    have = torch.autograd.grad(got, (q, k, v), g)
    for a, b in zip(have, want):
        assert float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0)) > 0.999


@pytest.mark.gpu
def test_chunked_logprob_memory_on_cuda_under_10_percent():
    from logprob_memory import measure

    row = measure(tokens=16384, vocab=151936, hidden_size=1024, dtype=torch.bfloat16, device="cuda")
    assert row["ratio"] <= 0.10, row
