"""Batch-invariant mode: each kernel gives a row the same bits whatever else is in the batch, and
the built-in engine's rollout logprobs equal the torch trainer's bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from miles_nvidia.batch_invariant.kernels import bi_attention, bi_log_softmax, bi_matmul, bi_row_sum
from miles_nvidia.batch_invariant.mode import BatchInvariantMode, key_ranges


def test_matmul_row_does_not_depend_on_batch(device):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(41, 72, generator=g).to(device, torch.bfloat16)
    b = torch.randn(72, 50, generator=g).to(device, torch.bfloat16)
    full = bi_matmul(a, b)
    for i in (0, 17, 40):
        assert torch.equal(bi_matmul(a[i : i + 1], b), full[i : i + 1])
    assert torch.equal(bi_matmul(a[5:30], b), full[5:30])
    torch.testing.assert_close(full.float(), a.float() @ b.float(), atol=0.05, rtol=0.02)


def test_row_reductions(device):
    x = torch.randn(9, 2500).to(device)
    torch.testing.assert_close(bi_row_sum(x), x.sum(-1), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(bi_row_sum(x, mean=True), x.mean(-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(bi_log_softmax(x), torch.log_softmax(x, -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(bi_log_softmax(x[3:4]), bi_log_softmax(x)[3:4])


def test_attention_padding_and_decode_invariance(device):
    """One sequence of 21 tokens: right-padded in a batch (trainer), left-padded (engine prefill),
    and one query at a time against a growing cache (engine decode) give the same bits."""
    g = torch.Generator().manual_seed(1)
    h, d, n, pad = 2, 16, 21, 7
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(device, torch.bfloat16) for _ in range(3))
    scale = d**-0.5
    # trainer: right padding with another row in the batch, causal
    other = torch.randn(1, h, n + pad, d, generator=g).to(device, torch.bfloat16)
    rp = lambda t: torch.cat([F.pad(t, (0, 0, 0, pad)), other])  # noqa: E731
    start, end = key_ranges(None, 2, n + pad, n + pad, True, device)
    train = bi_attention(rp(q), rp(k), rp(v), start, end, scale)[0, :, :n]
    # engine prefill: left padding
    lp = lambda t: F.pad(t, (0, 0, pad, 0))  # noqa: E731
    valid = torch.zeros(1, n + pad, dtype=torch.bool, device=device)
    valid[:, pad:] = True
    mask = (torch.ones(n + pad, n + pad, dtype=torch.bool, device=device).tril()[None] & valid[:, None])[:, None]
    start, end = key_ranges(mask, 1, n + pad, n + pad, False, device)
    prefill = bi_attention(lp(q), lp(k), lp(v), start, end, scale)[0, :, pad:]
    assert torch.equal(prefill, train)
    # engine decode: the last 5 queries one by one
    for i in range(n - 5, n):
        s = pad + i + 1
        start, end = key_ranges(valid[:, None, None, :s], 1, 1, s, False, device)
        out = bi_attention(lp(q)[:, :, pad + i : pad + i + 1], lp(k)[:, :, :s], lp(v)[:, :, :s], start, end, scale)
        assert torch.equal(out[0, :, 0], train[:, i])
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)[0]
    torch.testing.assert_close(train.float(), ref, atol=2e-2, rtol=2e-2)


def test_mode_routes_each_op_to_its_kernel(device, monkeypatch):
    import miles_nvidia.batch_invariant.mode as mode

    calls = []
    for name in ("bi_matmul", "bi_row_sum", "bi_log_softmax", "bi_attention"):
        real = getattr(mode, name)
        monkeypatch.setattr(mode, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    a, w = torch.randn(4, 32, device=device), torch.randn(16, 32, device=device)
    q = torch.randn(1, 2, 5, 16, device=device)
    with BatchInvariantMode(torch.bfloat16):
        assert (a @ w.t()).dtype == torch.bfloat16 and F.linear(a, w).dtype == torch.bfloat16
        a.pow(2).mean(-1, keepdim=True), a.sum(-1), torch.log_softmax(a, -1)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        a.sum(0)  # not the last dim: left to torch
    assert calls == ["bi_matmul", "bi_matmul", "bi_row_sum", "bi_row_sum", "bi_log_softmax", "bi_attention"]


def test_mode_intercepts_and_keeps_gradients(device):
    x = torch.randn(3, 5, 32, device=device, requires_grad=True)
    w = torch.randn(24, 32, device=device, requires_grad=True)
    with BatchInvariantMode(torch.float32):
        y = F.linear(x, w)
        z = torch.log_softmax(y, -1).mean(-1)
    ref_z = torch.log_softmax(F.linear(x, w), -1).mean(-1)
    torch.testing.assert_close(z, ref_z, atol=1e-5, rtol=1e-5)
    gx, gw = torch.autograd.grad(z.sum(), (x, w))
    rx, rw = torch.autograd.grad(ref_z.sum(), (x, w))
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-4)


def _rollout_vs_train(precision, device, platform, n_new, **model):
    from nvidia_helpers import tiny_pair

    from miles_core.rollout.base import SamplingParams
    from miles_core.train.batch import make_train_batch
    from miles_core.types import Prompt

    trainer, engine, tok = tiny_pair(precision, device, platform, **model)
    texts = ["12+3=", "7+40=", "1+1=", "88+9="]
    prompts = [Prompt(t, prompt_ids=tok.encode(t)) for t in texts]
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=n_new, temperature=1.0), n=2)
    batch = make_train_batch(samples, tok.pad_token_id)
    lp = trainer.compute_logprobs(batch)
    mask = batch.response_mask
    return lp * mask, batch.rollout_logprobs * mask, mask


def test_engine_and_trainer_logprobs_bitwise_equal_cpu():
    # under the Triton interpreter on CPU (or the GPU kernels when CUDA is there)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    small = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    train, roll, mask = _rollout_vs_train("bf16_batch_invariant", dev, "cuda" if dev == "cuda" else "cpu", 3, **small)
    assert mask.sum() > 0
    assert torch.equal(train, roll)


@pytest.mark.gpu
def test_qwen3_shaped_engine_trainer_kl_is_exactly_zero():
    """Qwen3-0.6B block shapes (hidden 1024, 16/8 heads of 128, MLP 3072, qk-norm), 4 layers."""
    shape = dict(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072)
    train, roll, mask = _rollout_vs_train("bf16_batch_invariant", "cuda", "cuda", 32, **shape)
    kl = ((roll - train) * mask).sum() / mask.sum()  # k1 estimator of KL(rollout || train)
    assert torch.equal(train, roll) and float(kl) == 0.0
