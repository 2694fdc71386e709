"""Split-K GEMM in Triton for the decode step's skinny GEMMs with a small output width, for the GPU;
and the gate/up GEMM with its SwiGLU epilogue.

For ``x`` [M, K] and an ``nn.Linear`` weight ``w`` [N, K], with the K blocks of ``BLOCK_K`` cut into
``SPLIT_K`` contiguous ranges of ``KB = cdiv(cdiv(K, BLOCK_K), SPLIT_K)`` blocks each::

    partial[s, m, n] = sum_{k in split s} x[m, k] * w[n, k]        (fp32)
    sum_s partial[s] = x @ w.T

At decode batch (M = 64 to 256) the o_proj (N = 1024, K = 2048) and down_proj (N = 1024, K = 3072)
GEMMs are weight-bandwidth bound, but N = 1024 gives cuBLAS few output tiles, so it reaches about
1 TB/s on an H200. Here the K dimension is split as well, so that ``cdiv(N, BLOCK_N) * SPLIT_K``
programs fill the SMs (:func:`choose_split`), each streaming its own ``[BLOCK_N, KB * BLOCK_K]``
slice of the weight once.

Grid ``(cdiv(N, BLOCK_N), SPLIT_K, cdiv(M, BLOCK_M))``: a program loads a ``[BLOCK_M, BLOCK_K]``
tile of x and a ``[BLOCK_N, BLOCK_K]`` tile of w per step over its K range, accumulates
``tl.dot`` in fp32 and writes its fp32 partial to ``partial[s]``; no atomics, so the result is
deterministic. The reduction over splits is left to the consumer (which sums splits 0..SPLIT_K-1 in
order, e.g. fused with the residual add and the norm); :func:`reduce_splits` is the plain torch sum,
for tests and benchmarks. ``BLOCK_M = min(64, max(16, next_power_of_2(M)))``: one M tile for
M <= 64 (16 is ``tl.dot``'s least size), and an M grid axis above that, rather than one tile of up
to 256 rows, so that shared memory per pipeline stage stays at ``(64 + BLOCK_N) * BLOCK_K`` elements
(4 stages of 256 x 128 bf16 x rows alone would not fit in an H200's 227 KiB) and the accumulator
stays small; the M axis is the slowest, so the M tiles' re-reads of the weight (4 MiB for o_proj)
should come from L2 (not measured yet). Rows past M and columns past N read a wrapped (valid) row
and are dropped at the store, so only the K tail is masked, and only when a split can run past K.
A split that starts at or past K (``SPLIT_K`` more than the K blocks would fill) writes zeros.
Departures: none in the math; with fp32 inputs the dots run in full fp32 (``input_precision="ieee"``),
not tf32.

Shapes: ``x`` [M, K] and ``w`` [N, K], same dtype, unit last stride; returns ``partial``
[SPLIT_K, M, N] fp32, contiguous.

:func:`gated_gemm` is the MLP's gate/up GEMM with the SwiGLU as its epilogue (no split: the
activation needs whole sums): each program accumulates a gate tile and the matching up tile.
"""

from __future__ import annotations

import torch

from miles_core.rollout.engine_core import triton_pdl
from miles_core.rollout.engine_core.triton_lib import available, tl, triton  # noqa: F401 (available: this module's API)


if triton is not None:
    from miles_core.rollout.engine_core.triton_pdl import pdl_wait, prefetch_rows

    @triton.jit
    def _splitk_kernel(
        X, W, P, M, N, K, s_xm, s_wn, s_ps, s_pm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
        EVEN_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        s = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows past M / N wrap to a valid row (their results are not stored): no M / N load masks
        rm = (offs_m % M).to(tl.int64)
        rn = (offs_n % N).to(tl.int64)
        k0 = s * (K_ITERS * BLOCK_K)  # first K of this split (a multiple of BLOCK_K)
        prefetch_rows(W, rn, s_wn, k0, tl.minimum(k0 + K_ITERS * BLOCK_K, K), LINE, LINES, PREFETCH)  # weights: before the wait
        pdl_wait(PDL)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = X + rm[:, None] * s_xm + offs_k[None, :]
        w_ptrs = W + rn[:, None] * s_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in range(K_ITERS):
            if EVEN_K:  # every split lies inside K
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                kmask = offs_k < K - i * BLOCK_K
                a = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
            if IEEE:  # fp32 inputs: full-precision dots (the default would round them to tf32)
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        p_ptrs = P + s.to(tl.int64) * s_ps + offs_m.to(tl.int64)[:, None] * s_pm + offs_n[None, :]
        tl.store(p_ptrs, acc.to(P.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


    @triton.jit
    def _gated_kernel(
        X, W, O, M, I, K, s_xm, s_wn, s_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
        PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr,
    ):
        """``O[:, n] = silu(X @ W[n].T) * (X @ W[I + n].T)`` for a [BLOCK_M, BLOCK_N] tile: the gate and
        up rows of the fused weight as two accumulators, rounded to the output dtype and combined as
        torch's ``F.silu(gate) * up`` rounds them."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = (offs_m % M).to(tl.int64)
        rn = (offs_n % I).to(tl.int64)
        prefetch_rows(W, rn, s_wn, 0, K, LINE, LINES, PREFETCH)  # gate rows, then up rows: before the wait
        prefetch_rows(W, rn + I, s_wn, 0, K, LINE, LINES, PREFETCH)
        pdl_wait(PDL)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X + rm[:, None] * s_xm + offs_k[None, :]
        g_ptrs = W + rn[:, None] * s_wn + offs_k[None, :]
        u_ptrs = g_ptrs + I * s_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs)
                g = tl.load(g_ptrs)
                u = tl.load(u_ptrs)
            else:
                kmask = offs_k < K - k0
                a = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=kmask[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=kmask[None, :], other=0.0)
            if IEEE:
                acc_g = tl.dot(a, tl.trans(g), acc_g, input_precision="ieee", out_dtype=tl.float32)
                acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision="ieee", out_dtype=tl.float32)
            else:
                acc_g = tl.dot(a, tl.trans(g), acc_g, out_dtype=tl.float32)
                acc_u = tl.dot(a, tl.trans(u), acc_u, out_dtype=tl.float32)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        dt = O.dtype.element_ty
        gate = acc_g.to(dt).to(tl.float32)  # the GEMM's output, rounded as F.linear's
        up = acc_u.to(dt).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)  # silu, rounded
        o_ptrs = O + offs_m.to(tl.int64)[:, None] * s_om + offs_n[None, :]
        tl.store(o_ptrs, (act * up).to(dt), mask=(offs_m < M)[:, None] & (offs_n < I)[None, :])


def gated_gemm(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 64, num_warps: int = 4,
               num_stages: int = 4, pdl: bool = False, prefetch: bool = True) -> torch.Tensor:
    """x [M, K], w [2I, K] (the fused gate/up weight, gate rows first) -> ``silu(x @ w[:I].T) * (x @ w[I:].T)``
    [M, I] in x's dtype, in one kernel: the MLP's gate/up GEMM with the SwiGLU as its epilogue (no
    [M, 2I] intermediate, no SwiGLU kernel). Each program streams ``2 * block_n`` weight rows.
    ``pdl``: launched as a programmatic dependent, and with ``prefetch`` prefetching its weight rows into L2
    before the wait (:mod:`.triton_pdl`)."""
    m, k = x.shape
    n2, k2 = w.shape
    assert k == k2 and n2 % 2 == 0, (x.shape, w.shape)
    assert x.dtype == w.dtype, (x.dtype, w.dtype)
    inter = n2 // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, inter, device=x.device, dtype=x.dtype)
    if m == 0 or inter == 0:
        return out
    bm = block_m(m)
    line, nlines = triton_pdl.lines(k, w.element_size())
    _gated_kernel[(_cdiv(inter, block_n), _cdiv(m, bm))](
        x, w, out, m, inter, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, IEEE=x.dtype == torch.float32,
        PDL=pdl, PREFETCH=pdl and prefetch, LINE=line, LINES=nlines, num_warps=num_warps, num_stages=num_stages, **triton_pdl.launch_opts(pdl),
    )
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_m(m: int) -> int:
    """The kernel's M tile for ``m`` rows (see the module docstring)."""
    return min(64, max(16, 1 << max(0, m - 1).bit_length()))


def splitk_gemm(x: torch.Tensor, w: torch.Tensor, split_k: int, block_n: int = 32, block_k: int = 128,
                num_warps: int = 4, num_stages: int = 4, pdl: bool = False, out_dtype: torch.dtype = torch.float32,
                prefetch: bool = True) -> torch.Tensor:
    """x [M, K] (unit last stride), w [N, K] (nn.Linear weight, unit last stride) -> fp32 partials [split_k, M, N]; sum(0) == x @ w.T.

    ``out_dtype``: the partials' dtype (with ``split_k=1``, x's dtype gives ``x @ w.T`` rounded as ``F.linear``'s
    output, for :func:`gemm`). ``pdl``, ``prefetch``: see :func:`gated_gemm`."""
    m, k = x.shape
    n, k2 = w.shape
    assert k == k2, (x.shape, w.shape)
    assert x.dtype == w.dtype, (x.dtype, w.dtype)
    assert split_k >= 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    partial = torch.empty(split_k, m, n, device=x.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return partial
    if k == 0:
        return partial.zero_()
    kb = _cdiv(k, block_k)
    k_iters = _cdiv(kb, split_k)
    bm = block_m(m)
    line, nlines = triton_pdl.lines(k_iters * block_k, w.element_size())
    _splitk_kernel[(_cdiv(n, block_n), split_k, _cdiv(m, bm))](
        x, w, partial, m, n, k, x.stride(0), w.stride(0), partial.stride(0), partial.stride(1),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=k_iters,
        EVEN_K=k % block_k == 0 and kb == k_iters * split_k, IEEE=x.dtype == torch.float32,
        PDL=pdl, PREFETCH=pdl and prefetch, LINE=line, LINES=nlines, num_warps=num_warps, num_stages=num_stages, **triton_pdl.launch_opts(pdl),
    )
    return partial


def gemm(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 64, pdl: bool = False, prefetch: bool = True) -> torch.Tensor:
    """``x @ w.T`` [M, N] in x's dtype through the split-K kernel with one split (the decode step's q/k/v
    GEMM when the step's kernels are chained by PDL, so that it prefetches its weights as the others do)."""
    return splitk_gemm(x, w, 1, block_n=block_n, block_k=block_k, pdl=pdl, out_dtype=x.dtype, prefetch=prefetch)[0]


def reduce_splits(partial: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[SPLIT_K, M, N] fp32 partials -> [M, N], summed over the splits in order 0..SPLIT_K-1 (the order
    the consumer kernel uses), in fp32, then cast to ``dtype`` (fp32 when None)."""
    out = partial[0].clone()
    for s in range(1, partial.shape[0]):
        out += partial[s]
    return out if dtype is None else out.to(dtype)


def choose_split(n: int, k: int, num_sms: int, block_n: int = 32, block_k: int = 128) -> int:
    """A split count so that ``cdiv(n, block_n) * split >= num_sms`` (about one wave), each split at least
    one ``block_k``, and ``split`` divides the K blocks evenly where possible; 1 when n already gives
    enough tiles.

    With ``tiles = cdiv(n, block_n)``, ``kb = cdiv(k, block_k)`` and ``need = min(kb, cdiv(num_sms,
    tiles))``: 1 when ``tiles >= num_sms``; else the least divisor of ``kb`` in ``[need, 2 * need]``
    (every split the same length, at most two waves); else the least ``s >= need`` that leaves no
    split empty (the K blocks are dealt ``cdiv(kb, s)`` to a split, so e.g. 5 splits of 16 blocks
    would leave the fifth empty). E.g. with 132 SMs: N=1024, K=2048 gives 32 tiles, need 5, 16
    blocks -> 8; N=4096, K=1024 gives 128 tiles (4 SMs short) -> 2; N=8192 -> 1.
    Only N tiles are counted: at M > 64 the kernel's M axis multiplies the programs (and each split
    adds an [M, N] fp32 partial to write and read), so a caller at large M may want fewer splits.
    """
    tiles = _cdiv(n, block_n)
    if tiles >= num_sms:
        return 1
    kb = max(1, _cdiv(k, block_k))
    need = min(kb, _cdiv(num_sms, tiles))
    for s in range(need, min(kb, 2 * need) + 1):
        if kb % s == 0:
            return s
    s = need
    while _cdiv(kb, _cdiv(kb, s)) != s:  # s = kb always satisfies this
        s += 1
    return s
