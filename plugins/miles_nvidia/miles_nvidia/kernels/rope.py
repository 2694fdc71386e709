"""Op "rope" in Triton: rotate-half rotary embedding, same semantics as
:func:`miles_core.kernels.rope.rope_torch` (``x`` [B, heads, T, D], ``cos``/``sin`` [B, 1, T, D]).

``out = x * cos + rot(x) * sin`` with rot(x1, x2) = (-x2, x1). The two halves of cos/sin carry
the same frequencies, so the transpose of the rotation is ``dx = g * cos + rot(g) * (-sin)``:
backward is the forward kernel with ``sin`` negated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_core.kernels.rope import rope_torch
from miles_nvidia.runtime import triton_ok


@triton.jit
def _rope_kernel(x_ptr, c_ptr, s_ptr, o_ptr, heads, T, sign, HALF: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # one (b, head, t) row of x
    b = row // (heads * T)
    t = row % T
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = row * 2 * HALF
    cs = (b * T + t) * 2 * HALF
    x1 = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + cs + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + cs + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + cs + cols, mask=mask, other=0.0).to(tl.float32) * sign
    s2 = tl.load(s_ptr + cs + HALF + cols, mask=mask, other=0.0).to(tl.float32) * sign
    tl.store(o_ptr + base + cols, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + base + HALF + cols, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=mask)


def _launch(x, cos, sin, sign):
    b, heads, t, d = x.shape
    out = torch.empty_like(x)
    if x.numel():
        _rope_kernel[(b * heads * t,)](x, cos, sin, out, heads, t, sign, HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2))
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        x = x.contiguous()
        cos = cos.expand(x.shape[0], 1, x.shape[2], x.shape[3]).contiguous()
        sin = sin.expand_as(cos).contiguous()
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _launch(g.contiguous(), cos, sin, -1.0), None, None


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not triton_ok(x, cos, sin) or x.shape[-1] % 2:
        return rope_torch(x, cos, sin)
    return _Rope.apply(x, cos, sin)
