"""Fixed-configuration Triton kernels: matmul, row sum/mean, row log-softmax, attention.

Invariance argument, kernel by kernel:
* matmul ``a [M, K] @ b [K, N]``: one tile config, no split-K, K walked in order; an output row
  depends only on its row of ``a`` and on ``b`` (``M`` is not specialised on).
* row reductions over the last dim: one program per row, a fixed 1024-wide vector accumulator
  walked left to right, then one tree of fixed shape.
* attention: for query row i of batch row b the visible keys are one range [start_b, end_{b,i});
  keys are visited in blocks aligned to ``start_b``, so a sequence left-padded by the engine and
  the same sequence right-padded by the trainer see identical blocks. Blocks past a row's end are
  exact no-ops of the online softmax (alpha = 1, p = 0). Query tiles are padded to one fixed
  BLOCK_M, so decode (one query) and prefill use the same instruction shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_nvidia.runtime import interpreting

RED_BLOCK = 1024


def _mm_cfg():
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn, mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (any strides, one dtype), fp32 accumulation, output in that dtype."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    cfg = _mm_cfg()
    if m and n:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        upcast = interpreting() or a.dtype == torch.float32
        _mm_kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), UPCAST=upcast, **cfg)
    return c


@triton.jit
def _row_sum_kernel(x_ptr, o_ptr, N, s_x, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * s_x + cols, mask=cols < N, other=0.0).to(tl.float32)
    total = tl.sum(acc, 0)
    if MEAN:
        total = total / N
    tl.store(o_ptr + row, total.to(o_ptr.dtype.element_ty))


def bi_row_sum(x: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """Sum (or mean) over the last dim; returns shape ``x.shape[:-1]`` in ``x.dtype``."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _row_sum_kernel[(x2.shape[0],)](x2, out, x2.shape[1], x2.stride(0), MEAN=mean, BLOCK=RED_BLOCK)
    return out.view(x.shape[:-1])


@triton.jit
def _log_softmax_kernel(x_ptr, o_ptr, N, s_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    mx = tl.full((BLOCK,), float("-inf"), tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mx = tl.maximum(mx, tl.load(x_ptr + row * s_x + cols, mask=cols < N, other=float("-inf")).to(tl.float32))
    m = tl.max(mx, 0)
    acc = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_x + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - m)
    lse = m + tl.log(tl.sum(acc, 0))
    for c0 in range(0, N, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * N + cols, (x - lse).to(o_ptr.dtype.element_ty), mask=cols < N)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, in ``x.dtype`` (fp32 internally)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _log_softmax_kernel[(x2.shape[0],)](x2, out, x2.shape[1], x2.stride(0), BLOCK=RED_BLOCK)
    return out.view(x.shape)


def _attn_cfg():
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, end_ptr, H, Tq, S, D, scale,
                 sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rq = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    qmask = rq < Tq
    dmask = rd < D
    q = tl.load(q_ptr + b * sqb + h * sqh + rq[:, None] * sqt + rd[None, :], mask=qmask[:, None] & dmask[None, :], other=0.0)
    ks = tl.load(start_ptr + b)
    ke = tl.load(end_ptr + b * Tq + rq, mask=qmask, other=0)
    ke_max = tl.max(ke, 0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(ks, ke_max, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        kv_mask = rn < S
        k = tl.load(k_ptr + b * skb + h * skh + rn[None, :] * skt + rd[:, None], mask=kv_mask[None, :] & dmask[:, None], other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        s = tl.where((rn[None, :] < ke[:, None]) & (rn[None, :] >= ks), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * svb + h * svh + rn[:, None] * svt + rd[None, :], mask=kv_mask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * sob + h * soh + rq[:, None] * sot + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=qmask[:, None] & dmask[None, :])


def bi_attention(q, k, v, start: torch.Tensor, end: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` [B, H, Tq, D], ``k``/``v`` [B, H, S, D] (one dtype), ``start`` [B] and ``end`` [B, Tq]
    int32: query i of row b attends to keys [start[b], end[b, i]). Output like ``q``."""
    b, h, tq, d = q.shape
    s = k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(b, h, tq, d, dtype=q.dtype, device=q.device)
    cfg = _attn_cfg()
    grid = (triton.cdiv(tq, cfg["BLOCK_M"]), b * h)
    upcast = interpreting() or q.dtype == torch.float32
    _attn_kernel[grid](q, k, v, out, start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous(), h, tq, s, d, float(scale),
                       q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                       BLOCK_D=max(16, triton.next_power_of_2(d)), UPCAST=upcast, **cfg)
    return out
