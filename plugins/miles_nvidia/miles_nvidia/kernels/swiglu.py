"""Op "swiglu" in Triton: ``silu(gate) * up`` elementwise, computed in fp32, stored in the input dtype.

Backward: with s = sigmoid(gate), ``d_up = g * gate * s`` and
``d_gate = g * up * s * (1 + gate * (1 - s))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_core.kernels.swiglu import swiglu_torch
from miles_nvidia.runtime import triton_ok

BLOCK = 1024


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, o_ptr, n, cols, s_row, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat index into the contiguous output
    mask = offs < n
    src = (offs // cols) * s_row + offs % cols  # inputs: rows of ``cols`` elements, ``s_row`` apart
    a = tl.load(g_ptr + src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(u_ptr + src, mask=mask, other=0.0).to(tl.float32)
    out = a * tl.sigmoid(a) * b
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(g_ptr, u_ptr, d_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    tl.store(du_ptr + offs, (d * a * s).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (d * b * s * (1.0 + a * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        # the two halves of a fused gate/up output ([rows, I] views, one row stride) are read in place
        strided = gate.dim() == 2 and gate.stride() == up.stride() and gate.stride(-1) == 1
        if not strided:
            gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        n = gate.numel()
        if n:
            cols = gate.shape[-1]
            _swiglu_fwd[(triton.cdiv(n, BLOCK),)](gate, up, out, n, cols, gate.stride(0) if strided else cols, BLOCK=BLOCK)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            ctx.save_for_backward(gate.contiguous(), up.contiguous())
        return out

    @staticmethod
    def backward(ctx, d):
        gate, up = ctx.saved_tensors
        d = d.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _swiglu_bwd[(triton.cdiv(n, BLOCK),)](gate, up, d, dg, du, n, BLOCK=BLOCK)
        return dg, du


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not triton_ok(gate, up) or gate.dtype != up.dtype:
        return swiglu_torch(gate, up)
    return _SwiGLU.apply(gate, up)
