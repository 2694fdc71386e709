"""RMSNorm, SwiGLU and RoPE kernels against the core's torch references (forward and backward)."""

import pytest
import torch

from miles_core.kernels.rmsnorm import rmsnorm_torch
from miles_core.kernels.rope import rope_torch
from miles_core.kernels.swiglu import swiglu_torch
from miles_core.models.decoder import RMSNorm, rotary
from miles_nvidia.kernels.rmsnorm import rmsnorm_triton
from miles_nvidia.kernels.rope import rope_triton
from miles_nvidia.kernels.swiglu import swiglu_triton


def _grads(out, inputs, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, g)


def test_core_references_match_the_decoder_modules():
    x = torch.randn(3, 5, 24)
    norm = RMSNorm(24, 1e-6)
    norm.weight.data.normal_()
    assert torch.equal(rmsnorm_torch(x, norm.weight, 1e-6), norm(x))
    cos, sin = torch.randn(3, 1, 5, 8), torch.randn(3, 1, 5, 8)
    q = torch.randn(3, 2, 5, 8)
    assert torch.equal(rope_torch(q, cos, sin), rotary(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm(device, dtype):
    x = torch.randn(6, 7, 40).to(device, dtype).requires_grad_()
    w = (torch.randn(40) * 0.1 + 1).to(device).requires_grad_()  # fp32 weight, as in the decoder
    out, ref = rmsnorm_triton(x, w, 1e-6), rmsnorm_torch(x, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(_grads(out, (x, w)), _grads(ref, (x, w))):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(device, dtype):
    gate = torch.randn(5, 300).to(device, dtype).requires_grad_()
    up = torch.randn(5, 300).to(device, dtype).requires_grad_()
    out, ref = swiglu_triton(gate, up), swiglu_torch(gate, up)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(_grads(out, (gate, up)), _grads(ref, (gate, up))):
        torch.testing.assert_close(a, b, **tol)


def test_rope_matches_reference_and_is_a_rotation(device):
    b, h, t, d = 2, 3, 5, 16
    pos = torch.arange(t).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.outer(pos, inv)
    emb = torch.cat((f, f), -1)[None, None].expand(b, 1, t, d)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    x = torch.randn(b, h, t, d).to(device).requires_grad_()
    out, ref = rope_triton(x, cos, sin), rope_torch(x, cos, sin)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)  # rotations keep norms
    for a, r in zip(_grads(out, (x,)), _grads(ref, (x,))):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
def test_full_shapes_on_gpu():
    x = torch.randn(8, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda")
    torch.testing.assert_close(rmsnorm_triton(x, w), rmsnorm_torch(x, w), atol=3e-2, rtol=1e-2)
    g, u = torch.randn(2, 2, 4096, 12288, device="cuda", dtype=torch.bfloat16).unbind(0)
    torch.testing.assert_close(swiglu_triton(g, u), swiglu_torch(g, u), atol=3e-2, rtol=1e-2)
    q = torch.randn(8, 32, 2048, 128, device="cuda", dtype=torch.bfloat16)
    cs = torch.randn(2, 8, 1, 2048, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = (torch.cat((c, c), -1) for c in cs.unbind(0))
    torch.testing.assert_close(rope_triton(q, cos, sin), rope_torch(q, cos, sin), atol=3e-2, rtol=1e-2)


def test_strided_views_of_a_fused_projection(device):
    """The engine slices q/k heads and gate/up halves out of fused GEMM outputs: no copies, same values."""
    qkv = torch.randn(5, 4 + 2 + 2, 16).to(device).requires_grad_()
    w = (torch.randn(16) * 0.1 + 1).to(device)
    k = qkv[:, 4:6]  # [5, 2, 16], strides (128, 16, 1)
    out = rmsnorm_triton(k, w, 1e-6)
    torch.testing.assert_close(out, rmsnorm_torch(k.contiguous(), w, 1e-6), atol=1e-5, rtol=1e-5)
    (g1,) = _grads(out, (qkv,))
    (g2,) = _grads(rmsnorm_torch(k, w, 1e-6), (qkv,))
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)
    gu = torch.randn(6, 2 * 300).to(device).requires_grad_()
    gate, up = gu.chunk(2, -1)
    out = swiglu_triton(gate, up)
    torch.testing.assert_close(out, swiglu_torch(gate, up), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_grads(out, (gu,))[0], _grads(swiglu_torch(gate, up), (gu,))[0], atol=1e-5, rtol=1e-5)
