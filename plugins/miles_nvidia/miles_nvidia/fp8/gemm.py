"""Blockwise-scaled FP8 GEMM: ``out = (a_q * a_s) @ (b_q * b_s).T`` in bf16/fp32.

``a_q`` [M, K] e4m3 with 1x128 scales ``a_s`` [M, K/128]; ``b_q`` [N, K] e4m3 with either 128x128
scales [N/128, K/128] (``b_rows=128``, a weight) or 1x128 scales [N, K/128] (``b_rows=1``, the
weight-gradient GEMM). Three implementations, best first:

* ``torch._scaled_mm`` with blockwise scales (cuBLAS >= 12.9 on sm90, torch >= 2.9): 1x128 scales
  "outer-dim-major" (``scale_a`` [M, K/128] with strides (1, M); for ``b_rows=1`` ``scale_b``
  [K/128, N] contiguous), 128x128 scales row-major (``scale_b = b_s.t()``). A layout torch rejects
  raises, and ``backend="auto"`` then falls back to Triton *silently* (the first wgrad layout did);
  the GPU test names the backend so that this cannot hide;
* a Triton kernel: one K tile of 128 per step, each partial product multiplied by its two scales
  before it is added (the same arithmetic as DeepSeek-V3's fine-grained scaling);
* a torch emulation (dequantise, then matmul in fp32), the reference for tests and CPU runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_nvidia.fp8.quant import BLOCK, dequantize_blockwise
from miles_nvidia.runtime import interpreting


def fp8_gemm_emulated(a_q, a_s, b_q, b_s, b_rows: int, out_dtype=torch.bfloat16, a_rows: int = 1) -> torch.Tensor:
    a = dequantize_blockwise(a_q, a_s, a_rows)
    b = dequantize_blockwise(b_q, b_s, b_rows)
    return (a @ b.t()).to(out_dtype)


def fp8_gemm_scaled_mm(a_q, a_s, b_q, b_s, b_rows: int, out_dtype=torch.bfloat16, a_rows: int = 1) -> torch.Tensor:
    m, k = a_q.shape
    if a_rows == 1:
        sa = a_s.t().contiguous().t()  # [M, K/128], M-major (a no-op for the Triton quantisers' layout)
    else:  # 128x128 blocks: [M/128, K/128] row-major, as the weight's
        sa = a_s.contiguous()
    if b_rows == 1:  # scale_b of mat2 = b_q.t() [K, N] is [K/128, N] contiguous (torch checks scale_b.t())
        sb = b_s.t().contiguous()
    else:  # 128x128: scale_b.t() must be [N/128, K/128] row-major, unpadded (checked by torch)
        sb = b_s.contiguous().t()
    return torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K, s_am, s_bn, s_sam, s_sak, s_sbn, s_sbk, s_cm,
                     A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile; programs in groups of ``GROUP_M`` tile rows (a group walks
    its rows before the next column, so the B tiles it shares stay in L2). Rows past M and columns
    past N read a wrapped (valid) row and are dropped at the store; only a K tail is masked.
    Scales are read through their strides (the quantisers' K-major storage: one contiguous load
    of a tile's 128 row scales per K step)."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :]
    b_ptrs = b_ptr + rn[:, None] * s_bn + rk[None, :]
    sa_ptrs = sa_ptr + (rm // A_ROWS) * s_sam
    sb_ptrs = sb_ptr + (rn // B_ROWS) * s_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = rk < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(b))
        sa = tl.load(sa_ptrs + kb * s_sak)
        sb = tl.load(sb_ptrs + kb * s_sbk)
        acc += part * sa[:, None] * sb[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * s_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# (block_m, block_n, warps, stages): the default launch, and the benchmark's sweep. On the H200
# (2026-12-04, bench_nvidia.py --only parts, docs/results/s9/call5_s9e) (128, 64, 4, 4) was the fastest
# of the sweep for every 8B wgrad: 680 TFLOP/s for gate_up, against cuBLAS's 829 in the same
# 1x128 x 1x128 form (the kernel before this rewrite: 480)
TRITON_CONFIG = (128, 64, 4, 4)
TRITON_SWEEP = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (64, 256, 4, 4), (128, 64, 4, 4), (64, 128, 4, 4))


def fp8_gemm_triton(a_q, a_s, b_q, b_s, b_rows: int, out_dtype=torch.bfloat16, config: tuple[int, int, int, int] | None = None,
                    a_rows: int = 1) -> torch.Tensor:
    """``config`` (block_m, block_n, warps, stages) overrides :data:`TRITON_CONFIG` (the benchmark sweeps it)."""
    m, k = a_q.shape
    n = b_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    bm, bn, warps, stages = config or ((16, 32, 4, 3) if interpreting() else TRITON_CONFIG)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](a_q, b_q, a_s, b_s, out, m, n, k, a_q.stride(0), b_q.stride(0), a_s.stride(0), a_s.stride(1),
                           b_s.stride(0), b_s.stride(1), out.stride(0), A_ROWS=a_rows, B_ROWS=b_rows, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK,
                           GROUP_M=8, EVEN_K=k % BLOCK == 0, UPCAST=interpreting(),
                           **({} if interpreting() else dict(num_warps=warps, num_stages=stages)))
    return out


def scaled_mm_supported(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and torch.cuda.get_device_capability(device) < (10, 0)


def scaled_mm_shape_ok(k: int, n: int) -> bool:
    """Shapes ``auto`` sends to ``torch._scaled_mm``: K and N multiples of 128 and K/128 a multiple of 4.

    The scale layouts above are unpadded, as torch 2.13 checks them. torch 2.9-2.11 wanted the
    128x128 scale's K/128 dim padded to a multiple of 4; where it is not one, the H200 run of
    2026-12-03 (torch 2.11) computed wrong products with the unpadded layout: the quickstart-size
    recipe, K = 128, started at loss 3.97 against bf16's 3.86 and went to NaN. Where K/128 is a
    multiple of 4, padded and unpadded are the same tensor, which the GPU tests check on both torch
    versions. Other shapes take the Triton GEMM."""
    return k % (4 * BLOCK) == 0 and n % BLOCK == 0


def fp8_gemm(a_q, a_s, b_q, b_s, b_rows: int, out_dtype=torch.bfloat16, backend: str = "auto", a_rows: int = 1) -> torch.Tensor:
    """Dispatch: ``backend`` is auto | scaled_mm | triton | emulated. ``a_rows``: 1 (``a_s`` 1x128 tiles,
    the default) or 128 (``a_s`` [M/128, K/128] blocks; M a multiple of 128)."""
    if backend == "auto":
        if a_q.is_cuda and scaled_mm_supported(a_q.device) and scaled_mm_shape_ok(a_q.shape[1], b_q.shape[0]):
            try:
                return fp8_gemm(a_q, a_s, b_q, b_s, b_rows, out_dtype, "scaled_mm", a_rows)
            except RuntimeError:  # a torch/cuBLAS without blockwise scaling (< 2.9 or CUDA < 12.9)
                backend = "triton"
        else:
            backend = "triton" if a_q.is_cuda else "emulated"
    if backend == "scaled_mm":
        m = a_q.shape[0]
        pad = (-m) % 16  # cuBLASLt wants M aligned
        assert a_rows == 1 or m % BLOCK == 0, (a_rows, m)
        if pad:
            a_q = torch.nn.functional.pad(a_q.view(torch.uint8), (0, 0, 0, pad)).view(a_q.dtype)
            a_s = torch.nn.functional.pad(a_s, (0, 0, 0, pad), value=1.0)
        return fp8_gemm_scaled_mm(a_q, a_s, b_q, b_s, b_rows, out_dtype, a_rows)[:m]
    if backend == "triton":
        return fp8_gemm_triton(a_q, a_s, b_q, b_s, b_rows, out_dtype, a_rows=a_rows)
    return fp8_gemm_emulated(a_q, a_s, b_q, b_s, b_rows, out_dtype, a_rows)
