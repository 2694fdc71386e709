"""Batch-invariant mode: a ``TorchFunctionMode`` that routes the ops whose result could depend on
the batch to the fixed kernels of :mod:`miles_nvidia.batch_invariant.kernels`.

Intercepted (on CUDA tensors, or anywhere under the Triton interpreter): ``F.linear``,
``torch.matmul`` / ``@`` on 2-D right operands, ``sum`` / ``mean`` over the last dim,
``log_softmax`` over the last dim and ``F.scaled_dot_product_attention`` (causal, or a boolean mask
whose visible keys form one range per query: causal with left or right padding). Everything else
is elementwise or a gather and is batch-invariant already. GEMMs and attention compute in
``compute_dtype`` (bf16 by default) with fp32 accumulation, as autocast would.

Backward runs outside the mode with ordinary torch ops (gradients need not be batch-invariant);
attention recomputes its forward with the math formula to get its gradient.

The mode is entered by the precision recipe (``train.precision=bf16_batch_invariant``) around
every forward of the torch trainer and of the built-in rollout engine, so both produce the same
bits for the same token.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from miles_core.precision.base import PrecisionRecipe
from miles_nvidia.batch_invariant.kernels import bi_attention, bi_log_softmax, bi_matmul, bi_row_sum
from miles_nvidia.runtime import interpreting, triton_ok


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w_t):  # x2 [M, K], w_t [K, N] (a view of W [N, K] or a right operand)
        ctx.save_for_backward(x2, w_t)
        return bi_matmul(x2, w_t)

    @staticmethod
    def backward(ctx, g):
        x2, w_t = ctx.saved_tensors
        return g @ w_t.t(), x2.t() @ g


class _RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mean):
        ctx.n, ctx.mean = x.shape[-1], mean
        return bi_row_sum(x, mean)

    @staticmethod
    def backward(ctx, g):
        g = g.unsqueeze(-1).expand(*g.shape, ctx.n)
        return (g / ctx.n if ctx.mean else g), None


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = bi_log_softmax(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g - out.exp() * g.sum(-1, keepdim=True)


def _reference_attention(q, k, v, start, end, scale):
    idx = torch.arange(k.shape[2], device=q.device)
    visible = (idx[None, None, :] >= start[:, None, None]) & (idx[None, None, :] < end[:, :, None])  # [B, Tq, S]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return (p @ v.float()).to(q.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, start, end, scale):
        ctx.save_for_backward(q, k, v, start, end)
        ctx.scale = scale
        return bi_attention(q, k, v, start, end, scale)

    @staticmethod
    def backward(ctx, g):
        q, k, v, start, end = ctx.saved_tensors
        with torch.enable_grad():
            qkv = [t.detach().requires_grad_() for t in (q, k, v)]
            out = _reference_attention(*qkv, start, end, ctx.scale)
            grads = torch.autograd.grad(out, qkv, g)
        return (*grads, None, None, None)


def key_ranges(mask: torch.Tensor | None, b: int, tq: int, s: int, is_causal: bool, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(start [B], end [B, Tq]) of the visible keys, or None if the mask is not of that form."""
    if mask is None:
        if not is_causal:
            return torch.zeros(b, dtype=torch.int32, device=device), torch.full((b, tq), s, dtype=torch.int32, device=device)
        end = torch.arange(tq, device=device, dtype=torch.int32) + 1 + (s - tq)
        return torch.zeros(b, dtype=torch.int32, device=device), end.expand(b, tq).contiguous()
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or is_causal:
        return None
    m = mask[:, 0].expand(b, tq, s)
    start = m[:, -1].int().argmax(-1).int()  # the last query sees the widest range
    end = (s - m.flip(-1).int().argmax(-1)).int()
    return start, end


@dataclass
class BatchInvariantMode(TorchFunctionMode):
    compute_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        super().__init__()

    def _mm(self, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype
        lead = x.shape[:-1]
        out = _Linear.apply(x.reshape(-1, x.shape[-1]).to(dt), w_t.to(dt))
        return out.view(*lead, w_t.shape[1])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._dispatch(func, args, kwargs)
        return func(*args, **kwargs) if out is NotImplemented else out

    def _dispatch(self, func, args, kwargs):
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if not triton_ok(x, w) or not x.is_floating_point():
                return NotImplemented
            y = self._mm(x, w.t())
            return y if bias is None else y + bias.to(y.dtype)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            a, b = args
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dim() == 2 and a.dim() >= 1 and a.is_floating_point() and triton_ok(a, b):
                return self._mm(a, b)
            return NotImplemented
        if func in (torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean):
            return self._reduce(func, args, kwargs)
        if func in (torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax):
            x = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if kwargs.get("dtype") is None and dim in (-1, x.dim() - 1) and x.is_floating_point() and triton_ok(x):
                return _LogSoftmax.apply(x)
            return NotImplemented
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return NotImplemented

    def _reduce(self, func, args, kwargs):
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        if kwargs.get("dtype") is not None or not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
            return NotImplemented
        if dim not in (-1, x.dim() - 1) or not triton_ok(x):
            return NotImplemented
        out = _RowSum.apply(x, func in (torch.mean, torch.Tensor.mean))
        return out.unsqueeze(-1) if keepdim else out

    def _attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p or enable_gqa or q.dim() != 4 or not triton_ok(q, k, v) or k.shape[1] != q.shape[1]:
            return NotImplemented
        b, _, tq, d = q.shape
        ranges = key_ranges(attn_mask, b, tq, k.shape[2], is_causal, q.device)
        if ranges is None:
            return NotImplemented
        dt = self.compute_dtype
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        return _Attention.apply(q.to(dt), k.to(dt), v.to(dt), *ranges, scale)


@dataclass(frozen=True)
class BatchInvariantRecipe(PrecisionRecipe):
    """``train.precision=bf16_batch_invariant``: fp32 master weights, bf16 GEMMs and attention
    through the batch-invariant kernels, in both the trainer and the built-in engine."""

    name: str = "bf16_batch_invariant"
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype | None = None  # no autocast: the mode casts GEMM inputs itself
    batch_invariant: bool = True
    mode_dtype: torch.dtype = torch.bfloat16

    def kernel_mode(self, device: torch.device) -> contextlib.AbstractContextManager:
        return BatchInvariantMode(self.mode_dtype)

    def unavailable(self, device: torch.device) -> str | None:
        """The mode's kernels are Triton kernels: off CUDA, outside the interpreter, it would hand every op back to
        torch, and the run would compute in plain fp32 (no autocast) with nothing batch-invariant."""
        if device.type == "cuda" or interpreting():
            return None
        return (
            "its batch-invariant kernels are Triton kernels, which run on CUDA, or on the CPU under the Triton "
            "interpreter (TRITON_INTERPRET=1, slow); without them the run would be plain fp32 and not batch-invariant. "
            "Use train.precision=fp32 or bf16, or set TRITON_INTERPRET=1"
        )
