"""The fused logprob kernel against the core's torch reference (interpreter on CPU, real on GPU)."""

import pytest
import torch

from miles_core.kernels.logprobs import logprobs_torch
from miles_nvidia.kernels.logprobs import logprobs_triton


def _case(m, h, v, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (m,), generator=g).to(device)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_backward_match_reference_fp32(device, temperature):
    hidden, weight, targets = _case(37, 40, 101, torch.float32, device)  # nothing a multiple of a block
    lp, ent = logprobs_triton(hidden, weight, targets, temperature=temperature)
    rlp, rent = logprobs_torch(hidden, weight, targets, temperature=temperature)
    torch.testing.assert_close(lp, rlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, rent, atol=1e-5, rtol=1e-5)
    g1, g2 = torch.randn(37, device=device), torch.randn(37, device=device)
    gh, gw = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((rlp * g1).sum() + (rent * g2).sum(), (hidden, weight))
    torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-4)


def test_bf16_close_to_fp32_reference(device):
    hidden, weight, targets = _case(20, 32, 70, torch.bfloat16, device, seed=1)
    lp, ent = logprobs_triton(hidden, weight, targets)
    rlp, rent = logprobs_torch(hidden.float(), weight.float(), targets)
    torch.testing.assert_close(lp, rlp, atol=2e-3, rtol=1e-3)  # fp32 accumulation of bf16 inputs
    torch.testing.assert_close(ent, rent, atol=2e-3, rtol=1e-3)


def test_fp32_master_weight_with_bf16_hidden_runs_the_kernel(device, monkeypatch):
    """The bf16 recipe hands the op bf16 hidden states and the fp32 master LM head: the kernel must
    serve it (cast the weight, as autocast does), not fall back to the torch reference, and the fp32
    weight must receive an fp32 gradient close to the reference's."""
    import miles_nvidia.kernels.logprobs as mod

    hidden, weight, targets = _case(20, 32, 70, torch.bfloat16, device, seed=3)
    w32 = weight.detach().float().requires_grad_()
    fell_back = []
    monkeypatch.setattr(mod, "logprobs_torch", lambda *a, **k: fell_back.append(1) or logprobs_torch(*a, **k))
    lp, ent = logprobs_triton(hidden, w32, targets)
    assert not fell_back
    with torch.no_grad():  # fp32 accumulation over the bf16 inputs, as the kernel does
        xlp, xent = logprobs_torch(hidden.float(), w32.to(torch.bfloat16).float(), targets)
    torch.testing.assert_close(lp, xlp, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(ent, xent, atol=2e-3, rtol=1e-3)
    rlp, rent = logprobs_torch(hidden, w32, targets)  # the reference casts the weight the same way
    (gw,) = torch.autograd.grad(lp.sum() + ent.sum(), (w32,))
    (rw,) = torch.autograd.grad(rlp.sum() + rent.sum(), (w32,))
    assert gw.dtype == torch.float32
    assert float(torch.nn.functional.cosine_similarity(gw.flatten(), rw.flatten(), dim=0)) > 0.999


def test_hand_worked_uniform_logits(device):
    # zero hidden -> all logits 0 -> logprob = -log V, entropy = log V
    v = 50
    hidden = torch.zeros(3, 16, device=device)
    weight = torch.randn(v, 16, device=device)
    lp, ent = logprobs_triton(hidden, weight, torch.tensor([0, 7, 49], device=device))
    expect = torch.full((3,), float(torch.log(torch.tensor(float(v)))), device=device)
    torch.testing.assert_close(lp, -expect)
    torch.testing.assert_close(ent, expect)


def test_backward_slices_the_vocab(device, monkeypatch):
    # force several vocab slices in backward: the result must not depend on the slicing
    import miles_nvidia.kernels.logprobs as mod

    hidden, weight, targets = _case(16, 16, 130, torch.float32, device, seed=2)
    lp, ent = logprobs_triton(hidden, weight, targets)
    full = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
    monkeypatch.setattr(mod, "SLICE_BYTES", 16 * 4 * 32)  # one 32-column slice at a time
    lp, ent = logprobs_triton(hidden, weight, targets)
    sliced = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
    for a, b in zip(full, sliced):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
def test_full_shape_on_gpu():
    hidden, weight, targets = _case(2048, 1024, 151936, torch.bfloat16, "cuda")
    lp, ent = logprobs_triton(hidden, weight, targets)
    rlp, rent = logprobs_torch(hidden, weight, targets)
    # both run bf16 GEMMs (the torch reference also rounds the logits to bf16): judge each against an
    # fp32 pass over the same bf16 inputs; the kernel must be at least about as accurate as the reference
    with torch.no_grad():
        lp32, ent32 = logprobs_torch(hidden.float(), weight.float(), targets)
    for got, ref, exact in ((lp, rlp, lp32), (ent, rent, ent32)):
        e_got, e_ref = (got.float() - exact).abs(), (ref.float() - exact).abs()
        assert float(e_got.mean()) <= 1.5 * float(e_ref.mean()) + 1e-3, (float(e_got.mean()), float(e_ref.mean()))
        assert float(e_got.max()) <= 1.5 * float(e_ref.max()) + 1e-2, (float(e_got.max()), float(e_ref.max()))
    # gradients, judged the same way: against an fp32 pass over the same bf16 inputs
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    lp32, ent32 = logprobs_torch(h32, w32, targets)
    exact = torch.autograd.grad(lp32.sum() + ent32.sum(), (h32, w32))
    got = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
    ref = torch.autograd.grad(rlp.sum() + rent.sum(), (hidden, weight))
    for g, r, x in zip(got, ref, exact):
        e_got, e_ref = (g.float() - x).norm() / x.norm(), (r.float() - x).norm() / x.norm()
        assert float(e_got) <= 1.5 * float(e_ref) + 1e-3, (float(e_got), float(e_ref))
