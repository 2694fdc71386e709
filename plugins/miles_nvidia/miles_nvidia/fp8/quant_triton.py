"""Triton versions of :func:`quantize_act` / :func:`quantize_weight` (one pass over the tensor:
block amax, scale, divide, saturate, cast), the same arithmetic as :mod:`miles_nvidia.fp8.quant`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_nvidia.fp8.quant import BLOCK, E4M3, E4M3_MAX


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, s_xm, s_qm, s_sm, ROWS: tl.constexpr, COLS: tl.constexpr, QMAX: tl.constexpr):
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rk = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROWS == 1:
        amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-12)  # [1]
        scale = amax / QMAX
        q = x / scale[:, None]
        tl.store(s_ptr + rm * s_sm + tl.program_id(1), scale, mask=rm < M)
    else:
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-12)
        scale = amax / QMAX
        q = x / scale
        tl.store(s_ptr + tl.program_id(0) * s_sm + tl.program_id(1), scale)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(q_ptr + rm[:, None] * s_qm + rk[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_triton(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` = 1 (1x128 tiles) or 128 (128x128 blocks); ``x`` [M, K] with unit last stride."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = torch.empty(triton.cdiv(m, rows), triton.cdiv(k, BLOCK), dtype=torch.float32, device=x.device)
    if m and k:
        _quant_kernel[(triton.cdiv(m, rows), triton.cdiv(k, BLOCK))](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                                                                     ROWS=rows, COLS=BLOCK, QMAX=E4M3_MAX)
    return q, s
