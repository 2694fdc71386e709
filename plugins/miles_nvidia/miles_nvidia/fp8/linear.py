"""FP8 linear layers for training, and the ``fp8`` precision recipe.

Forward ``y = x @ W.T`` with x [M, K] in 1x128 tiles and W [N, K] in 128x128 blocks; backward does
both GEMMs in FP8 as well: ``dx = dy @ W`` (dy [M, N] in 1x128 tiles along N, ``q(W).T`` [K, N] with
the transposed block scales) and ``dW = dy.T @ x`` (dy.T [N, Mp] in 1x128 tiles along the token dim,
x.T [K, Mp] in 128x128 blocks by default, below; Mp = M rounded up with zero tokens), all accumulated
in fp32 and returned in the input's / weight's dtype. Master weights stay in bf16 (``param_dtype``), so
the optimizer never sees FP8. Quantisation per training step of one linear: x and x.T (forward; x.T is
what backward keeps, in FP8: 1 byte per element instead of a bf16 copy of x), dy and dy.T (backward),
each pair by two streaming kernels, and the weight once per optimizer step (below; its transposed copy
q(W).T is a torch copy, see :mod:`miles_nvidia.fp8.quant_triton` for why).

Weight-gradient operands (``MILES_FP8_WGRAD``), a departure from DeepSeek-V3 by default:

* ``blocks`` (default): x.T in 128x128 blocks (128 channels x 128 tokens; a block's scale is the max of
  the forward's row-tile scales, so no amax pass; tokens padded to a multiple of 512 for cuBLAS), dy.T in
  1x128 tiles: the wgrad runs cuBLAS's 1x128 x 128x128 form, as the forward and dgrad do;
* ``tiles``: x.T in 1x128 tiles along the tokens too, as DeepSeek-V3 does: the 1x128 x 1x128 form,
  which cuBLAS runs at about 850 TFLOP/s against 1,250-1,330 for the other (H200, 8B shapes);
* ``dy_blocks``: dy.T in 128x128 blocks, x.T in tiles (DeepSeek-V3 reports block-quantised activation
  gradients hurting training; here to be measured).

Why ``blocks`` is the default (H200 and this repo's CPU, 2026-12-04; docs/benchmarks.md, sessions 10-11):
8B gate_up forward+backward 1.43-1.46x bf16 against 1.36-1.37x for ``tiles`` (medians of interleaved
rounds); on the activations and gradients of a real model (SmolLM2-135M on English text,
``plugins/miles_nvidia/benchmarks/fp8_wgrad_error.py``) its dW error is 1.00-1.04x the error of ``tiles``
per layer kind (``dy_blocks``: 1.04-1.35x); the 200-step quickstart loss over 16 seeds is +0.60% from
bf16 (``tiles`` +0.51%, fp32 +0.34%: one seed alone moves by up to 5%). A block shares one scale over
128 tokens x 128 channels, so a value far below the block's largest keeps less relative precision than
in its own tile (e4m3 keeps 3 mantissa bits down to about 3.5e-5 of the scale's amax);
where that matters, ``MILES_FP8_WGRAD=tiles`` gives DeepSeek-V3's recipe.

Weight cache (departure from DeepSeek-V3's "quantise on the fly" and from this module's first
version): :class:`Fp8Linear` keeps, on the module instance, one quantisation of its weight --
``q(W)``, its block scales and ``q(W).T`` for the dgrad GEMM (128x128 block scales do not change under
transposition, so one pass gives both) -- keyed on ``(data_ptr, W._version, shape, dtype)``. Autograd
bumps ``_version`` on every in-place write through the parameter (for-loop and foreach optimizer
steps, ``load_state_dict``, ``copy_``), so the cache is recomputed exactly when the weight changes,
and reused across the micro-batches of one step and by activation-checkpointing recomputes. Costs
2 bytes per weight element of GPU memory. Caution: torch's *fused* optimizers (``fused=True``) change
the weights without bumping ``_version`` (torch 2.13), so they need :func:`clear_fp8_cache` after each
step; the trainer's AdamW is foreach/for-loop (guarded by a test).
Not cached (quantised every forward, as before): under ``torch.distributed`` with several ranks (FSDP2 all-gathers new
values into the same unsharded storage with the version counter preserved, see
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``), under ``torch.compile`` tracing and
inference mode. Writes through ``.data`` are invisible to the version counter: call
:func:`clear_fp8_cache` after one. The free function :func:`fp8_linear` quantises W every call.
The LM head stays in bf16 (the logprob op reads it directly).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from miles_core.precision.base import PrecisionRecipe
from miles_nvidia.fp8.gemm import fp8_gemm, fp8_gemm_triton
from miles_nvidia.fp8.quant import BLOCK, quantize_act, quantize_act_both, quantize_weight


def wgrad_gemm() -> tuple[str, tuple[int, int, int, int] | None]:
    """``MILES_FP8_WGRAD_GEMM``: unset (the module's backend, ``torch._scaled_mm`` on sm90), ``triton``, or
    ``triton:BM,BN,WARPS,STAGES`` (a launch of :func:`~miles_nvidia.fp8.gemm.fp8_gemm_triton`): which GEMM
    computes the weight gradient (the benchmark compares them)."""
    v = os.environ.get("MILES_FP8_WGRAD_GEMM", "")
    if not v.startswith("triton"):
        return "", None
    cfg = tuple(int(c) for c in v.split(":", 1)[1].split(",")) if ":" in v else None
    if cfg is not None and len(cfg) != 4:
        raise ValueError(f"MILES_FP8_WGRAD_GEMM={v!r}: give triton:BM,BN,WARPS,STAGES")
    return "triton", cfg


WGRAD_MODES = ("blocks", "tiles", "dy_blocks")
FP8_MIN_CAPABILITY = (8, 9)  # Triton's e4m3 (fp8e4nv): Ada and newer


def wgrad_mode() -> str:
    """``MILES_FP8_WGRAD``: the weight-gradient GEMM's operands (see the module docstring). ``blocks``
    (default): x.T in 128x128 blocks; ``tiles``: dy.T and x.T both in 1x128 tiles along the tokens;
    ``dy_blocks``: dy.T in 128x128 blocks. A block mode runs cuBLAS's 1x128 x 128x128 form."""
    mode = os.environ.get("MILES_FP8_WGRAD", "blocks")
    if mode not in WGRAD_MODES:
        raise ValueError(f"MILES_FP8_WGRAD={mode!r}: one of {', '.join(WGRAD_MODES)}")
    return mode


@dataclass(frozen=True)
class Fp8Weight:
    """One quantisation of a weight [N, K]: ``q`` [N, K] e4m3 with 128x128 scales ``s``
    [N/128, K/128], and ``qt = q.T`` [K, N] contiguous with ``st = s.T`` contiguous (dgrad; None
    when made with ``transposed=False``)."""

    q: torch.Tensor
    s: torch.Tensor
    qt: torch.Tensor | None
    st: torch.Tensor | None

    @classmethod
    def of(cls, w: torch.Tensor, transposed: bool = True) -> Fp8Weight:
        with torch.no_grad():
            if not transposed:
                return cls(*quantize_weight(w.detach()), None, None)
            q, s, qt = quantize_weight(w.detach(), transposed=True)
        return cls(q, s, qt, s.t().contiguous())


@dataclass
class Fp8WeightCache:
    """Per-module cache of :class:`Fp8Weight` (see the module docstring for when it is recomputed)."""

    key: tuple | None = None
    value: Fp8Weight | None = None
    quantisations: int = 0  # how many times the weight was quantised (tests and benchmarks read it)

    def get(self, w: torch.Tensor) -> Fp8Weight:
        key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device)
        if key != self.key or self.value is None:
            self.key, self.value = key, Fp8Weight.of(w)
            self.quantisations += 1
        return self.value


def _cacheable(w: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or w.is_inference():  # compiling first: dynamo folds it
        return False
    # several ranks: FSDP2 may refill the weight's storage (see the module docstring); a one-rank group
    # (the Megatron trainer starts one in every process) shards nothing
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, backend, wq, keep_xt):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        wq = wq if wq is not None else Fp8Weight.of(weight, transposed=ctx.needs_input_grad[0])  # q(W).T: dgrad only
        # keep_xt: a weight gradient will be asked for (grad mode on, weight requires grad; inside forward grad
        # mode is always off and needs_input_grad is set under no_grad too, so the caller decides)
        # wgrad operand layout: x.T in 1x128 tiles along tokens (DeepSeek-V3's), or in 128x128 blocks; a block
        # mode pads the tokens to a multiple of 512 (cuBLAS's 128x128 scales want K/128 a multiple of 4)
        ctx.mode = wgrad_mode()
        ctx.pad = BLOCK if ctx.mode == "tiles" else 4 * BLOCK
        if keep_xt:  # x's row tiles (this GEMM) and x.T's wgrad operand, kept in FP8 for backward
            qx, sx, qxt, sxt = quantize_act_both(x2, ctx.pad, t_blocks=ctx.mode == "blocks")
            ctx.save_for_backward(qxt, sxt)
        else:
            qx, sx = quantize_act(x2)
        y = fp8_gemm(qx, sx, wq.q, wq.s, BLOCK, torch.bfloat16, backend)
        ctx.wq, ctx.backend, ctx.shape, ctx.xdtype, ctx.wdtype = wq, backend, shape, x.dtype, weight.dtype
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        wq, backend = ctx.wq, ctx.backend
        dy2 = dy.reshape(-1, dy.shape[-1]).to(torch.bfloat16)
        if ctx.needs_input_grad[1]:  # dy's row tiles (dgrad) and dy.T's wgrad operand (blocks in the dy_blocks mode)
            qdy, sdy, qdyt, sdyt = quantize_act_both(dy2, ctx.pad, t_blocks=ctx.mode == "dy_blocks")
        else:
            qdy, sdy = quantize_act(dy2)
        a_rows, b_rows = {"tiles": (1, 1), "blocks": (1, BLOCK), "dy_blocks": (BLOCK, 1)}[ctx.mode]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(qdy, sdy, wq.qt, wq.st, BLOCK, torch.bfloat16, backend).view(ctx.shape).to(ctx.xdtype)
        if ctx.needs_input_grad[1]:  # dW = dy.T @ x, reduced over tokens (zero-padded to whole tiles)
            qxt, sxt = ctx.saved_tensors
            out = ctx.wdtype if ctx.wdtype in (torch.bfloat16, torch.float32) else torch.float32
            which, cfg = wgrad_gemm()
            if which == "triton" and qdyt.is_cuda:
                dw = fp8_gemm_triton(qdyt, sdyt, qxt, sxt, b_rows, out, cfg, a_rows=a_rows).to(ctx.wdtype)
            else:
                dw = fp8_gemm(qdyt, sdyt, qxt, sxt, b_rows, out, backend, a_rows=a_rows).to(ctx.wdtype)
        return dx, dw, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, backend: str = "auto", wq: Fp8Weight | None = None) -> torch.Tensor:
    """``x @ weight.T`` through blockwise FP8; ``wq`` a quantisation of ``weight`` to reuse (else made here)."""
    keep_xt = torch.is_grad_enabled() and weight.requires_grad
    return _Fp8LinearFn.apply(x, weight, backend, wq, keep_xt)


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` (no bias) computing through :func:`fp8_linear`; same parameters and names.
    Holds ``fp8_cache`` (:class:`Fp8WeightCache`), made on first use (modules become Fp8Linear by a
    class swap, so ``__init__`` does not run)."""

    fp8_backend = "auto"

    def fp8_weight(self) -> Fp8Weight | None:
        if not _cacheable(self.weight):
            return None
        if "fp8_cache" not in self.__dict__:
            self.fp8_cache = Fp8WeightCache()
        return self.fp8_cache.get(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.fp8_backend, self.fp8_weight())


def clear_fp8_cache(model: nn.Module) -> None:
    """Drop every :class:`Fp8Linear`'s cached weight quantisation (after writes through ``.data``)."""
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            mod.__dict__.pop("fp8_cache", None)


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

    def unavailable(self, device: torch.device) -> str | None:
        """On CUDA the quantisers and the GEMM fallback are Triton kernels on e4m3, which Triton compiles for
        compute capability 8.9 and newer only (the CPU runs the torch emulation)."""
        if device.type != "cuda":
            return None
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_MIN_CAPABILITY:
            return (
                f"blockwise FP8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper) for e4m3; "
                f"this one is sm_{major}{minor}; use train.precision=bf16"
            )
        return None

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
