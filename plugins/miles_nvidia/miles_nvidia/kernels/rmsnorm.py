"""Op "rmsnorm" in Triton: one program per row; same semantics as
:func:`miles_core.kernels.rmsnorm.rmsnorm_torch` (statistic in fp32, normalised value rounded to
``x.dtype``, then multiplied by ``weight``).

Backward (torch, from the saved fp32 ``rstd``): with xh = x * rstd and dxh = g * w,
``dx = rstd * (dxh - xh * mean(dxh * xh))``, ``dw = sum_rows(g * xh)``. Departure: the rounding
of xh to ``x.dtype`` is treated as the identity in backward (straight-through).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_core.kernels.rmsnorm import rmsnorm_torch
from miles_nvidia.runtime import triton_ok


@triton.jit
def _rmsnorm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, N, H, s_outer, s_inner, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # row (a, h) of x viewed as [A, H, N] with strides (s_outer, s_inner, 1)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + (row // H) * s_outer + (row % H) * s_inner + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    xh = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * xh.to(tl.float32)
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        if x.dim() == 3 and x.stride(-1) == 1:  # e.g. the q or k heads sliced out of a fused qkv output: no copy
            x3 = x
        else:
            x3 = x.reshape(-1, 1, shape[-1]).contiguous()
        n = shape[-1]
        rows = x3.shape[0] * x3.shape[1]
        y = torch.empty(rows, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            _rmsnorm_fwd[(rows,)](x3, weight.contiguous(), y, rstd, n, x3.shape[1], x3.stride(0), x3.stride(1), float(eps),
                                  BLOCK=triton.next_power_of_2(n))
        x2 = x3.reshape(rows, n) if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] else x3.new_empty(0, n)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(*shape[:-1], n)

    @staticmethod
    def backward(ctx, g):
        x2, weight, rstd = ctx.saved_tensors
        g = g.reshape(x2.shape).float()
        xh = x2.float() * rstd[:, None]
        dxh = g * weight.float()
        dx = rstd[:, None] * (dxh - xh * (dxh * xh).mean(-1, keepdim=True))
        dw = (g * xh.to(x2.dtype).float()).sum(0)
        return dx.to(x2.dtype).view(ctx.shape), dw.to(weight.dtype), None


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    if not triton_ok(x, weight):
        return rmsnorm_torch(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)
