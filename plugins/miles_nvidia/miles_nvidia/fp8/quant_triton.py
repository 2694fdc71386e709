"""Triton quantisers, bitwise equal to the torch reference :func:`miles_nvidia.fp8.quant.quantize_blockwise`.

Same arithmetic as the reference: ``amax = max(max|tile|, 1e-12)``, ``s = amax / 448``,
``q = cast_e4m3(clamp(x / s, -448, 448))``, both divisions IEEE round-to-nearest (``div_rn``; Triton's
``/`` is an approximate division on NVIDIA GPUs), the cast round-to-nearest-even.

* :func:`quantize_act_triton` -- 1x128 tiles along K: ``x`` [M, K] -> ``q`` [M, K], ``s`` [M, K/128].
  Each program takes a [32, 128] tile (one amax per row), not one row (a program per 1x128
  tile made M*K/128 programs of 128 elements, slower than the GEMM it feeds).
* :func:`quantize_act_t_triton` -- the wgrad operand: 1x128 tiles of ``x.T`` along the token dim, i.e.
  ``q(pad(x).T)`` [K, Mp] and ``s`` [K, Mp/128] with ``Mp = ceil(M/128)*128``. Default (fused):
  reading ``x`` [M, K] once, each program loads a [128 tokens, 32] tile, takes the amax down each
  column and stores the tile transposed; the zero rows M..Mp are the masked loads. Unfused
  (``MILES_FP8_FUSED_TRANSPOSE=0`` or ``fused=False``): torch makes ``pad(x).T`` contiguous (one bf16
  copy) and the row kernel quantises it. :func:`quantize_act_t_blocks_triton`: the same in 128x128
  blocks, from the row tiles' scales.
* :func:`quantize_act_both_triton` -- both layouts of one tensor (the forward's x, the backward's dy):
  the row kernel, then the column kernel. Two kernels that read x once each beat every one-read kernel
  tried on the H200 (``bench_nvidia.py --only fp8``): a [128, 128] block walked in [32, 128] pieces,
  reloaded from cache for the second layout (0.9 TB/s against 1.9, 2026-12-03/04), and one [128, 128]
  tile per program held in registers (8 or 16 warps; ptxas spills 400-800 bytes a thread): 1.8 ms
  against 0.95 for dy [16384, 24576] (2026-12-04, docs/benchmarks.md, session 11).
* :func:`quantize_weight_triton` -- 128x128 blocks, ``s`` [N/128, K/128]; with ``transposed=True`` also
  ``q(W).T`` [K, N] (a block's scale does not change under transposition, so ``q(W.T) = q(W).T`` and
  its scales are ``s.T``). Default: torch copies ``q.T`` (exact); fused (opt-in,
  ``MILES_FP8_FUSED_WEIGHT_TRANSPOSE=1`` or ``fused=True``): the kernel stores it too.

The fused weight transpose is opt-in because it is wrong on the H200 (issue #7; torch 2.11, Triton
3.6, sm90): its q(W).T has foreign bytes (12.5M of 25M at 6144x4096; e4m3 NaN bytes, hence a NaN
loss), while its untransposed store is right. Session 4 blamed ``tl.trans`` of an f8 tensor (a
``ttg.convert_layout`` through shared memory; cf. triton-lang/triton#11111). Since session 5 every
transposed tile moves as its int8 bytes (:func:`_bytes`, int8 views of the outputs), so no kernel
moves an f8 tensor between layouts (tests/sm90_ptx.py checks the sm90 TTGIR) -- and the weight
kernel still writes the same wrong bytes, so that was not the cause; it is not yet known (the
kernel holds a [128, 128] fp32 tile in 8 warps at 255 registers). The activation kernels, through
the same int8 moves, are bitwise equal to the reference at full shapes on the H200
(``test_gpu_quantisers_bitwise_full_shapes``, 2026-12-03), hence fused by default. The
interpreter runs no such lowering: only a GPU run can show either result.

Scales are returned as dequantisation multipliers in outer-dim-major storage (``s.t()`` contiguous),
the layout ``torch._scaled_mm`` wants for 1x128 scales, so no copy is made before the GEMM.

Under ``TRITON_INTERPRET=1`` the e4m3 cast is preceded by an explicit round-to-nearest-even in fp32
(:func:`_to_e4m3`): Triton 3.7's interpreter truncates on fp32 -> e4m3 (ties away, lost carries, tiny
values flushed to 0); it casts exactly representable values exactly, so the result matches the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from miles_nvidia.fp8.quant import BLOCK, E4M3, E4M3_MAX
from miles_nvidia.runtime import interpreting


@triton.jit
def _to_e4m3(q, EMULATE_RNE: tl.constexpr):
    """fp32 in [-448, 448] -> e4m3, round to nearest even."""
    if EMULATE_RNE:  # interpreter only: round in fp32 so that the cast below is exact
        u = q.to(tl.uint32, bitcast=True)
        sign = u & 0x80000000
        a = (u ^ sign).to(tl.float32, bitcast=True)
        # below 2^-6 (e4m3 subnormals) the step is 2^-9: the fp32 ulp of 1.5 * 2^14
        sub = (a + 24576.0) - 24576.0
        # normal range: round fp32's 23 mantissa bits to e4m3's 3 (a carry bumps the exponent)
        b = a.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000
        r = tl.where(a < 0.015625, sub, b.to(tl.float32, bitcast=True))
        q = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return q.to(tl.float8e4nv)


@triton.jit
def _bytes(q8):
    """An e4m3 tile as its int8 bytes, for transposing: transposed tiles move between layouts as
    int8 (the ``qt`` pointers are int8 views of the e4m3 outputs), never as f8 (see the module doc)."""
    return q8.to(tl.int8, bitcast=True)


@triton.jit
def _scale(amax, QMAX: tl.constexpr):
    """The dequantisation multiplier of tiles whose abs-max is ``amax``."""
    amax = tl.maximum(amax, 1e-12)
    return tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))


@triton.jit
def _quant(x, scale, QMAX: tl.constexpr):
    """``clamp(x / scale)`` in fp32 (``scale`` broadcastable to x)."""
    q = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))  # div_rn does not broadcast
    return tl.minimum(tl.maximum(q, -QMAX), QMAX)


@triton.jit
def _act_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, s_xm, s_qm, s_sk,
                     BLOCK_M: tl.constexpr, TILE: tl.constexpr, QMAX: tl.constexpr, EMULATE_RNE: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M*K may pass 2^31
    rk = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = _scale(tl.max(tl.abs(x), 1)[:, None], QMAX)  # [BLOCK_M, 1]
    q = _quant(x, scale, QMAX)
    tl.store(q_ptr + rm[:, None] * s_qm + rk[None, :], _to_e4m3(q, EMULATE_RNE), mask=mask)
    tl.store(s_ptr + tl.program_id(1) * s_sk + rm[:, None], scale, mask=rm[:, None] < M)


@triton.jit
def _act_cols_kernel(x_ptr, qt_ptr, st_ptr, M, K, s_xm, s_qtk, s_stm, s_stk,
                     BLOCK_K: tl.constexpr, TILE: tl.constexpr, QMAX: tl.constexpr, EMULATE_RNE: tl.constexpr,
                     GIVEN_SCALES: tl.constexpr):
    """``GIVEN_SCALES``: quantise with the 128x128 block scales at ``st_ptr`` ([K/128, Mp/128], strides
    ``s_stk``, ``s_stm``) instead of each column's amax (which it then does not store)."""
    rm = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)  # tokens; rows M..Mp load as zeros
    rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if GIVEN_SCALES:
        scale = tl.load(st_ptr + (rk // TILE)[None, :] * s_stk + tl.program_id(0) * s_stm, mask=rk[None, :] < K, other=1.0)
    else:
        scale = _scale(tl.max(tl.abs(x), 0)[None, :], QMAX)  # one per column: [1, BLOCK_K]
    qt = tl.trans(_bytes(_to_e4m3(_quant(x, scale, QMAX), EMULATE_RNE)))  # [BLOCK_K, TILE]
    tl.store(qt_ptr + rk[:, None] * s_qtk + rm[None, :], qt, mask=rk[:, None] < K)
    if not GIVEN_SCALES:
        tl.store(st_ptr + tl.program_id(0) * s_stm + rk[None, :], scale, mask=rk[None, :] < K)


@triton.jit
def _weight_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, N, K, s_wn, s_qn, s_qtk, s_sn,
                   TILE: tl.constexpr, QMAX: tl.constexpr, TRANSPOSED: tl.constexpr, EMULATE_RNE: tl.constexpr):
    rn = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    rk = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    x = tl.load(w_ptr + rn[:, None] * s_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = _scale(tl.max(tl.max(tl.abs(x), 1, keep_dims=True), 0, keep_dims=True), QMAX)  # [1, 1]
    q8 = _to_e4m3(_quant(x, scale, QMAX), EMULATE_RNE)
    tl.store(q_ptr + rn[:, None] * s_qn + rk[None, :], q8, mask=mask)
    if TRANSPOSED:
        tl.store(qt_ptr + rk[:, None] * s_qtk + rn[None, :], tl.trans(_bytes(q8)), mask=(rk[:, None] < K) & (rn[None, :] < N))
    tl.store(s_ptr + tl.program_id(0) * s_sn + tl.program_id(1) + tl.zeros((1, 1), tl.int32), scale)


# the scale of an all-zero tile, max(0, 1e-12) / 448 in fp32 (IEEE division, as the kernels' div_rn): a
# constant, so that padding scales costs no device-to-host read
_ZERO_TILE_SCALE = float(torch.tensor(1e-12, dtype=torch.float32) / torch.tensor(E4M3_MAX, dtype=torch.float32))


def _warps(n: int) -> dict:
    return {} if interpreting() else {"num_warps": n}


def fused_transpose(fused: bool | None = None) -> bool:
    """Whether the activations' transposed tiles come from the fused kernels (default, see the module doc)."""
    return fused if fused is not None else os.environ.get("MILES_FP8_FUSED_TRANSPOSE", "1") != "0"


def fused_weight_transpose(fused: bool | None = None) -> bool:
    """Whether q(W).T comes from the weight kernel (opt-in: wrong on the H200, see the module doc)."""
    return fused if fused is not None else os.environ.get("MILES_FP8_FUSED_WEIGHT_TRANSPOSE", "") == "1"


def _padded_t(x: torch.Tensor, pad: int = BLOCK) -> torch.Tensor:
    """``pad(x, Mp).T`` contiguous [K, Mp] in one transposing copy (zero columns M..Mp)."""
    m, k = x.shape
    mp = triton.cdiv(m, pad) * pad
    xt = x.new_empty(k, mp)
    xt[:, :m].copy_(x.t())
    xt[:, m:].zero_()
    return xt


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2, x.shape
    return x if x.stride(-1) == 1 else x.contiguous()


def quantize_act_triton(x: torch.Tensor, block_m: int | None = None, warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> ``q`` [M, K] e4m3, ``s`` [M, ceil(K/128)] fp32 (M-major storage). ``block_m`` and
    ``warps`` shape the launch (the benchmark sweeps them)."""
    x = _unit_stride(x)
    m, k = x.shape
    # 32 rows x 128 columns over 4 warps: the fastest or within 5% of it in every 8B shape on the H200
    # (bench_nvidia.py --only parts, 2026-12-04: 0.35 ms for dy [16384, 24576], 3.4 TB/s; 16 x 8 warps, the
    # earlier launch, 0.42 ms)
    bm = block_m or 32
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    st = torch.empty(triton.cdiv(k, BLOCK), m, dtype=torch.float32, device=x.device)
    if m and k:
        _act_rows_kernel[(triton.cdiv(m, bm), triton.cdiv(k, BLOCK))](  # tokens on grid x (no 65535 cap)
            x, q, st, m, k, x.stride(0), q.stride(0), st.stride(0),
            BLOCK_M=bm, TILE=BLOCK, QMAX=E4M3_MAX, EMULATE_RNE=interpreting(), **_warps(warps))
    return q, st.t()


def quantize_act_t_triton(x: torch.Tensor, fused: bool | None = None, warps: int | None = None, block_k: int = 32, pad: int = BLOCK):
    """``x`` [M, K] -> ``qt`` [K, Mp] e4m3, ``st`` [K, Mp/128] fp32 (K-major storage), the 1x128 tiles
    of ``pad(x, Mp).T``, ``Mp`` a multiple of ``pad`` (a multiple of 128). ``block_k`` and ``warps`` shape
    the column kernel (the benchmark sweeps them)."""
    assert pad % BLOCK == 0, pad
    if not fused_transpose(fused):
        return quantize_act_triton(_padded_t(x, pad))  # the row kernel on a contiguous copy of pad(x).T
    x = _unit_stride(x)
    m, k = x.shape
    mp = triton.cdiv(m, pad) * pad
    qt = torch.empty(k, mp, dtype=E4M3, device=x.device)
    stt = torch.empty(mp // BLOCK, k, dtype=torch.float32, device=x.device)
    if mp and k:
        # [128 tokens, 32] over 4 warps: the fastest in every 8B shape on the H200 (bench_nvidia.py --only
        # parts, 2026-12-04: 0.49 ms for dy [16384, 24576], 2.5 TB/s; [128, 64] over 16 warps, the earlier
        # launch, 0.88 ms)
        _act_cols_kernel[(mp // BLOCK, triton.cdiv(k, block_k))](
            x, qt.view(torch.int8), stt, m, k, x.stride(0), qt.stride(0), stt.stride(0), stt.stride(1),
            BLOCK_K=block_k, TILE=BLOCK, QMAX=E4M3_MAX, EMULATE_RNE=interpreting(), GIVEN_SCALES=False, **_warps(warps or 4))
    return qt, stt.t()


def quantize_act_both_triton(x: torch.Tensor, pad: int = BLOCK, t_blocks: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both FP8 layouts of an activation (or of its gradient): ``(q, s, qt, st)``, ``q``/``s`` as
    :func:`quantize_act_triton` gives them (the forward's or dgrad's operand) and ``qt``/``st`` the
    wgrad operand ``pad(x, Mp).T``: in 1x128 tiles along the tokens as :func:`quantize_act_t_triton`
    gives them, or with ``t_blocks`` in 128x128 blocks as :func:`quantize_act_t_blocks_triton` (from the
    row tiles' scales). Two streaming kernels, each reading x once: on the H200 every one-read kernel
    tried was slower (see the module doc). :func:`miles_nvidia.fp8.quant.quantize_act_both` reaches the
    same kernels on CUDA; this one runs them anywhere (the interpreter's tests)."""
    q, s = quantize_act_triton(x)
    return q, s, *(quantize_act_t_blocks_triton(x, s, pad) if t_blocks else quantize_act_t_triton(x, pad=pad))


def quantize_act_t_blocks_triton(x: torch.Tensor, row_scales: torch.Tensor, pad: int = 4 * BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``pad(x, Mp).T`` [K, Mp] in 128x128 blocks, ``Mp`` a multiple of ``pad``: ``qt`` [K, Mp] e4m3 and
    ``s`` [ceil(K/128), Mp/128] fp32, bitwise :func:`quantize_blockwise` of ``pad(x).T`` with 128-row blocks.

    ``row_scales`` [M, ceil(K/128)] are x's 1x128 row-tile scales (the forward's :func:`quantize_act_triton`):
    a block's scale is the largest of its 128 tokens' tile scales, exactly (``max(a) / 448 == max(a / 448)``
    under a monotonic rounding), so x is read once more, by the column kernel quantising with those scales;
    the zero tokens M..Mp count as all-zero tiles."""
    x = _unit_stride(x)
    m, k = x.shape
    mp = triton.cdiv(m, pad) * pad
    kb = triton.cdiv(k, BLOCK)
    sr = torch.nn.functional.pad(row_scales.t(), (0, mp - m), value=_ZERO_TILE_SCALE)  # [KB, Mp]
    s = sr.view(kb, mp // BLOCK, BLOCK).amax(-1).contiguous()  # [KB, Mp/128]
    qt = torch.empty(k, mp, dtype=E4M3, device=x.device)
    if mp and k:
        _act_cols_kernel[(mp // BLOCK, triton.cdiv(k, 32))](
            x, qt.view(torch.int8), s, m, k, x.stride(0), qt.stride(0), s.stride(1), s.stride(0),
            BLOCK_K=32, TILE=BLOCK, QMAX=E4M3_MAX, EMULATE_RNE=interpreting(), GIVEN_SCALES=True, **_warps(4))
    return qt, s


def quantize_weight_triton(w: torch.Tensor, transposed: bool = False, fused: bool | None = None):
    """``w`` [N, K] -> ``q`` [N, K] e4m3, ``s`` [ceil(N/128), ceil(K/128)] fp32; with ``transposed``
    also ``qt = q.T`` [K, N] contiguous (its scales are ``s.T``)."""
    w = _unit_stride(w)
    n, k = w.shape
    in_kernel = transposed and fused_weight_transpose(fused)
    q = torch.empty(n, k, dtype=E4M3, device=w.device)
    qt = torch.empty(k, n, dtype=E4M3, device=w.device) if in_kernel else q
    s = torch.empty(triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK), dtype=torch.float32, device=w.device)
    if n and k:
        _weight_kernel[(s.shape[0], s.shape[1])](
            w, q, qt.view(torch.int8), s, n, k, w.stride(0), q.stride(0), qt.stride(0), s.stride(0),
            TILE=BLOCK, QMAX=E4M3_MAX, TRANSPOSED=in_kernel, EMULATE_RNE=interpreting(), **_warps(8))
    if transposed and not in_kernel:
        qt = q.t().contiguous()  # torch's transposing copy of the bytes: exactly q.T
    return (q, s, qt) if transposed else (q, s)
