"""FP8 linear layers for training, and the ``fp8`` precision recipe.

Forward ``y = x @ W.T`` with x in 1x128 tiles and W in 128x128 blocks; backward does both GEMMs
in FP8 as well: ``dx = dy @ W`` (dy in 1x128 tiles along N, W's blocks transposed) and
``dW = dy.T @ x`` (dy.T and x.T in 1x128 tiles along the token dim), all accumulated in fp32 and
returned in bf16. Master weights stay in bf16 (``param_dtype``); the FP8 copies are made on the fly
each step, so the optimizer never sees FP8. Departure from DeepSeek-V3: no fp32 master copy and
no delayed/cached weight quantisation (simpler; costs one weight quantisation per forward).
The LM head stays in bf16 (the logprob op reads it directly).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from miles_core.precision.base import PrecisionRecipe
from miles_nvidia.fp8.gemm import fp8_gemm
from miles_nvidia.fp8.quant import BLOCK, quantize_act, quantize_weight


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, backend):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        qw, sw = quantize_weight(weight)
        qx, sx = quantize_act(x2)
        y = fp8_gemm(qx, sx, qw, sw, BLOCK, torch.bfloat16, backend)
        ctx.save_for_backward(x2, qw, sw)
        ctx.backend, ctx.shape, ctx.wdtype = backend, shape, weight.dtype
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, qw, sw = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)
        qdy, sdy = quantize_act(dy2)
        dx = fp8_gemm(qdy, sdy, qw.t().contiguous(), sw.t().contiguous(), BLOCK, torch.bfloat16, ctx.backend)
        # dW = dy.T @ x: the reduction runs over tokens, padded with zero rows to whole tiles
        dyt, xt = _pad_rows(dy2, BLOCK).t().contiguous(), _pad_rows(x2, BLOCK).t().contiguous()
        qa, sa = quantize_act(dyt)
        qb, sb = quantize_act(xt)
        dw = fp8_gemm(qa, sa, qb, sb, 1, torch.float32, ctx.backend)
        return dx.view(ctx.shape).to(dy.dtype), dw.to(ctx.wdtype), None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    return _Fp8LinearFn.apply(x, weight, backend)


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` (no bias) computing through :func:`fp8_linear`; same parameters and names."""

    fp8_backend = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.fp8_backend)


def convert_to_fp8(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Turn every bias-free ``nn.Linear`` whose dims are multiples of 128 into :class:`Fp8Linear`
    in place (the class is swapped; parameters and state-dict names do not change). Returns the
    names converted."""
    done = []
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and mod.bias is None and not any(s in name for s in skip):
            if mod.in_features % BLOCK == 0 and mod.out_features % BLOCK == 0:
                mod.__class__ = Fp8Linear
                done.append(name)
    return done


@dataclass(frozen=True)
class Fp8Recipe(PrecisionRecipe):
    """``train.precision=fp8``: bf16 weights, bf16 autocast, blockwise FP8 GEMMs in the linears."""

    name: str = "fp8"
    param_dtype: torch.dtype = torch.bfloat16
    compute_dtype: torch.dtype | None = torch.bfloat16

    def prepare_model(self, model: nn.Module) -> nn.Module:
        for p in model.parameters():  # parameters only: buffers such as RoPE's inv_freq stay fp32
            p.data = p.data.to(self.param_dtype)
        convert_to_fp8(model)
        return model

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
