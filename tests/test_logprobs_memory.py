"""The chunked "logprobs" op: same values and gradients as log_softmax, at <= 10% of its memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from logprob_memory import LiveBytes, measure  # noqa: E402

from miles_core.kernels.logprobs import logprobs_torch  # noqa: E402


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_log_softmax_values_and_grads(temperature):
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    a, b = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    lp, ent = logprobs_torch(h, w, y, temperature=temperature, chunk_size=8)  # 5 chunks, the last partial
    ((lp.double() * a).sum() + (ent.double() * b).sum()).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logp_all = torch.log_softmax(h @ w.t() / temperature, -1)  # float64 reference
    lp_ref = logp_all.gather(1, y[:, None]).squeeze(1)
    ent_ref = -(logp_all.exp() * logp_all).sum(-1)
    ((lp_ref * a).sum() + (ent_ref * b).sum()).backward()
    # the op's logits are fp32 by design, so agreement is to fp32 rounding
    assert torch.allclose(lp.double(), lp_ref, atol=1e-5) and torch.allclose(ent.double(), ent_ref, atol=1e-5)
    assert torch.allclose(gh, h.grad, atol=2e-5) and torch.allclose(gw, w.grad, atol=2e-5)


def test_live_bytes_accounting_hand_worked():
    mode = LiveBytes()
    with mode:
        x = torch.empty(1000, device="meta")  # 4000 bytes
        y = torch.empty(500, device="meta", dtype=torch.float64)  # 4000 bytes, peak 8000
        del x
        z = torch.empty(250, device="meta")  # 1000 bytes, live 5000
    assert mode.peak == 8000 and mode.current == 5000
    del y, z


def test_peak_memory_vocab_151936_tokens_16k_is_under_10_percent():
    row = measure(tokens=16384, vocab=151936, hidden_size=1024, dtype=torch.bfloat16)
    # naive keeps several fp32 [16384, 151936] tensors (~9.3 GiB each); chunked ~2 fp32 [1024, V] + grad W
    assert row["naive_bytes"] > 3 * 16384 * 151936 * 4
    assert row["ratio"] <= 0.10, row
