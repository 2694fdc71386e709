"""Fused final linear + log-softmax + entropy: op "logprobs" without a [tokens, vocab] tensor.

Same signature and semantics as :func:`miles_core.kernels.logprobs.logprobs_torch`:
``hidden`` [M, H], ``weight`` [V, H], ``targets`` [M] -> ``(logprobs [M], entropy [M])`` fp32, with
``z = hidden @ weight.T / temperature``, ``lse = logsumexp(z)``, ``logprob = z[target] - lse`` and
``entropy = lse - sum(softmax(z) * z)``.

Forward: one Triton program per block of rows walks the vocab in blocks, accumulating the logits
tile in fp32 and folding it into an online logsumexp (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"), the running ``sum(p z)`` and the target logit. Memory: O(M).

Backward: with g = d loss / d logprob and e = d loss / d entropy,
``dz_j = g ([j == target] - p_j) - e p_j (z_j - E_p[z])``. The logits are recomputed one vocab
slice at a time (a Triton GEMM whose epilogue turns them into ``dz / temperature``); that slice
of dlogits [M, S] feeds two cuBLAS GEMMs (``dh += dlogits @ W_s``, ``dW_s = dlogits.T @ h``). The
slice width S is chosen so the slice stays under 256 MiB. Departure from a fully fused backward:
the [M, S] slice is materialised (never [M, V]), which keeps the backward deterministic
(no atomics) and lets cuBLAS do the two big GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_core.kernels.logprobs import logprobs_torch
from miles_nvidia.runtime import interpreting, triton_ok

SLICE_BYTES = 256 * 2**20


@triton.jit
def _logits_tile(h_ptr, w_ptr, rm, rv, M, V, K, s_hm, s_hk, s_wv, s_wk,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + rm[:, None] * s_hm + rk[None, :] * s_hk, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rv[None, :] * s_wv + rk[:, None] * s_wk, mask=(rv[None, :] < V) & (rk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(h.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, w, acc)
    return acc


@triton.jit(do_not_specialize=["M"])  # a row's bits must not depend on M
def _fwd_kernel(h_ptr, w_ptr, t_ptr, lp_ptr, ent_ptr, lse_ptr, M, V, K, s_hm, s_hk, s_wv, s_wk, temperature,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rm < M
    tgt = tl.load(t_ptr + rm, mask=rmask, other=0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_i = tl.zeros((BLOCK_M,), tl.float32)
    t_i = tl.zeros((BLOCK_M,), tl.float32)
    z_t = tl.zeros((BLOCK_M,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        rv = v0 + tl.arange(0, BLOCK_V)
        vmask = rv < V
        z = _logits_tile(h_ptr, w_ptr, rm, rv, M, V, K, s_hm, s_hk, s_wv, s_wk, BLOCK_M, BLOCK_V, BLOCK_K, IEEE)
        z = z / temperature
        z = tl.where(vmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(z, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(z - m_new[:, None])
        s_i = s_i * alpha + tl.sum(p, 1)
        t_i = t_i * alpha + tl.sum(tl.where(vmask[None, :], p * z, 0.0), 1)
        z_t += tl.sum(tl.where(rv[None, :] == tgt[:, None], z, 0.0), 1)
        m_i = m_new
    lse = m_i + tl.log(s_i)
    tl.store(lp_ptr + rm, z_t - lse, mask=rmask)
    tl.store(ent_ptr + rm, lse - t_i / s_i, mask=rmask)
    tl.store(lse_ptr + rm, lse, mask=rmask)


@triton.jit(do_not_specialize=["M"])
def _bwd_kernel(h_ptr, w_ptr, t_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, d_ptr, M, V, K, v_start, S,
                s_hm, s_hk, s_wv, s_wk, s_dm, temperature,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the slice
    rv = v_start + rs
    rmask = rm < M
    vmask = (rv < V) & (rs < S)
    z = _logits_tile(h_ptr, w_ptr, rm, rv, M, V, K, s_hm, s_hk, s_wv, s_wk, BLOCK_M, BLOCK_V, BLOCK_K, IEEE)
    z = z / temperature
    lse = tl.load(lse_ptr + rm, mask=rmask, other=0.0)
    ez = lse - tl.load(ent_ptr + rm, mask=rmask, other=0.0)
    g = tl.load(glp_ptr + rm, mask=rmask, other=0.0)
    e = tl.load(gent_ptr + rm, mask=rmask, other=0.0)
    tgt = tl.load(t_ptr + rm, mask=rmask, other=-1)
    p = tl.exp(z - lse[:, None])
    dz = -g[:, None] * p - e[:, None] * p * (z - ez[:, None])
    dz += tl.where(rv[None, :] == tgt[:, None], g[:, None], 0.0)
    dz = tl.where(vmask[None, :], dz / temperature, 0.0)
    out_mask = rmask[:, None] & vmask[None, :]
    tl.store(d_ptr + rm[:, None] * s_dm + rs[None, :], dz.to(d_ptr.dtype.element_ty), mask=out_mask)


def _blocks(dtype: torch.dtype) -> dict:
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_V=32, BLOCK_K=16)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_V=64, BLOCK_K=32, num_warps=4)
    return dict(BLOCK_M=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        m, k = hidden.shape
        v = weight.shape[0]
        lp = torch.empty(m, dtype=torch.float32, device=hidden.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        cfg = _blocks(hidden.dtype)
        ieee = hidden.dtype == torch.float32 or interpreting()  # the interpreter mis-computes bf16 dots
        if m:
            grid = (triton.cdiv(m, cfg["BLOCK_M"]),)
            _fwd_kernel[grid](hidden, weight, targets, lp, ent, lse, m, v, k, hidden.stride(0), hidden.stride(1),
                              weight.stride(0), weight.stride(1), float(temperature), IEEE=ieee, **cfg)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature = float(temperature)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        m, k = hidden.shape
        v = weight.shape[0]
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.float().contiguous()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
        cfg = _blocks(hidden.dtype)
        ieee = hidden.dtype == torch.float32 or interpreting()  # the interpreter mis-computes bf16 dots
        bv = cfg["BLOCK_V"]
        width = max(bv, min(v, SLICE_BYTES // max(m * hidden.element_size(), 1)) // bv * bv)
        d_hidden = torch.zeros(m, k, dtype=torch.float32, device=hidden.device)
        d_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        buf = torch.empty(m, width, dtype=hidden.dtype, device=hidden.device)
        for v0 in range(0, v, width):
            s = min(width, v - v0)
            d = buf[:, :s]
            grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(s, bv))
            _bwd_kernel[grid](hidden, weight, targets, lse, ent, g_lp, g_ent, d, m, v, k, v0, s,
                              hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), d.stride(0),
                              ctx.temperature, IEEE=ieee, **cfg)
            w_s = weight[v0 : v0 + s]
            d_hidden += (d @ w_s).float()
            if d_weight is not None:
                d_weight[v0 : v0 + s] = d.t() @ hidden
        dh = d_hidden.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        return dh, d_weight, None, None


def logprobs_triton(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Op "logprobs" (see the module docstring); falls back to the torch reference off-GPU.

    An fp32 ``weight`` with half-precision ``hidden`` (the bf16 recipe's fp32 master LM head) is cast
    to ``hidden``'s dtype first, as autocast does for a linear layer and as the torch reference does;
    the cast is differentiable, so the fp32 weight receives the gradient. ``chunk_size`` is accepted
    for signature compatibility and ignored (nothing is chunked)."""
    if hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32:
        weight = weight.to(hidden.dtype)
    if not triton_ok(hidden, weight) or hidden.dtype != weight.dtype:
        return logprobs_torch(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)
    return _FusedLogprobs.apply(hidden.contiguous(), weight, targets.contiguous(), temperature)
