"""Blockwise e4m3 quantisation (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 3.3).

A tensor is cut into blocks along its last two dims; each block gets one fp32 scale
``s = amax(|block|) / 448`` (448 = the largest e4m3 value) and stores ``q = cast_e4m3(x / s)``, so
that ``x ~= q * s``. Activations use 1x128 tiles (one scale per row per 128 columns), weights
128x128 blocks. Scales are kept as dequantisation multipliers (what ``torch._scaled_mm`` takes and
what HF FP8 checkpoints call ``weight_scale_inv``). Shapes need not be multiples of the block:
edge blocks are padded with zeros for the statistic only.

Error bound: e4m3 has 3 mantissa bits, so ``|x - q s| <= 2^-4 |x|`` for values in e4m3's normal range
(relative half-ulp), plus ``s * 2^-10`` (half the smallest subnormal step) for tiny values.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128


def _blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, int, int]:
    m, k = x.shape
    pm, pk = (-m) % rows, (-k) % cols
    xp = torch.nn.functional.pad(x.float(), (0, pk, 0, pm))
    return xp.view((m + pm) // rows, rows, (k + pk) // cols, cols), m, k


def quantize_blockwise(x: torch.Tensor, rows: int, cols: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (``q`` [M, K] e4m3, ``scale`` [ceil(M/rows), ceil(K/cols)] fp32)."""
    xb, m, k = _blocks(x, rows, cols)
    amax = xb.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    # a tensor divisor, not the Python float: CUDA torch turns ``t / scalar`` into ``t * (1 / scalar)``
    # (BinaryDivTrueKernel.cu), which is not IEEE division and differs from amax / 448 in the last bit
    # for about half of all amax values (issue #7); tensor / tensor divides exactly on CPU and CUDA
    scale = amax / torch.full_like(amax, E4M3_MAX)
    q = (xb / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.view(xb.shape[0] * rows, xb.shape[2] * cols)[:m, :k]
    return q.contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int = BLOCK, dtype=torch.float32) -> torch.Tensor:
    m, k = q.shape
    full = scale.repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k]
    return (q.float() * full).to(dtype)


def _pad_rows(x: torch.Tensor, multiple: int = BLOCK) -> torch.Tensor:
    pad = (-x.shape[0]) % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


# On CUDA each function below runs the Triton quantisers (miles_nvidia.fp8.quant_triton), bitwise
# equal to the torch reference used elsewhere.
def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles: ``x`` [M, K] -> ``q`` [M, K], ``scale`` [M, ceil(K/128)]."""
    if x.is_cuda:
        from miles_nvidia.fp8.quant_triton import quantize_act_triton

        return quantize_act_triton(x)
    return quantize_blockwise(x, 1)


def quantize_act_t(x: torch.Tensor, pad: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles of ``x.T`` along the token dim, for the weight-gradient GEMM: ``x`` [M, K] ->
    ``qt`` [K, Mp], ``st`` [K, Mp/128] with ``Mp`` = M rounded up to a multiple of ``pad`` (zero rows pad
    the tokens)."""
    if x.is_cuda:
        from miles_nvidia.fp8.quant_triton import quantize_act_t_triton

        return quantize_act_t_triton(x, pad=pad)
    return quantize_blockwise(_pad_rows(x, pad).t(), 1)


def quantize_act_both(x: torch.Tensor, pad: int = BLOCK, t_blocks: bool = False):
    """What one activation (or gradient) feeds two GEMMs with: ``(q, s, qt, st)``, :func:`quantize_act`
    of ``x`` and the wgrad operand ``pad(x).T`` -- :func:`quantize_act_t`, or with ``t_blocks``
    :func:`quantize_act_t_blocks` (on CUDA from the row tiles' scales ``s``)."""
    q, s = quantize_act(x)
    return q, s, *(quantize_act_t_blocks(x, s, pad) if t_blocks else quantize_act_t(x, pad))


def quantize_act_t_blocks(x: torch.Tensor, row_scales: torch.Tensor | None = None, pad: int = 4 * BLOCK):
    """``x.T`` in 128x128 blocks, the wgrad operand of the ``MILES_FP8_WGRAD=blocks`` mode
    (:mod:`miles_nvidia.fp8.linear`): ``x`` [M, K] -> ``qt`` [K, Mp], ``s`` [ceil(K/128), Mp/128], ``Mp`` a
    multiple of ``pad``. On CUDA from x's row-tile scales ``row_scales`` (see the Triton function)."""
    if x.is_cuda:
        from miles_nvidia.fp8.quant_triton import quantize_act_t_blocks_triton

        return quantize_act_t_blocks_triton(x, row_scales if row_scales is not None else quantize_act(x)[1], pad)
    return quantize_blockwise(_pad_rows(x, pad).t(), BLOCK)


def quantize_weight(w: torch.Tensor, transposed: bool = False):
    """128x128 blocks: ``w`` [N, K] -> ``q`` [N, K], ``scale`` [ceil(N/128), ceil(K/128)]; with
    ``transposed`` also ``q.T`` [K, N] contiguous (``q(W.T) == q(W).T``, scales ``scale.T``)."""
    if w.is_cuda:
        from miles_nvidia.fp8.quant_triton import quantize_weight_triton

        return quantize_weight_triton(w, transposed)
    q, s = quantize_blockwise(w, BLOCK)
    return (q, s, q.t().contiguous()) if transposed else (q, s)
