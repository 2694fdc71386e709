"""Fused decode-step kernels in Triton, for the GPU: fewer, larger launches per layer.

A decode step at batch 64 is a few hundred tiny kernels; on the H200 each costs a few µs whatever
its size, so the step is bound by their count as much as by bandwidth. Three fusions, each the
same math as the op chain it replaces (fp32 statistics and rotary, rounded to the model dtype where
the decoder's Triton ops round):

``qkv_prologue``  after the fused q/k/v GEMM, one program per (token, head)::

    q_h = rope(rmsnorm(q_h, w_q))                        -> q out [N, H, D]
    k_h = rope(rmsnorm(k_h, w_k)); v_h                   -> K/V cache slot of the token
    slot = block_table[p // page] * page + p % page      (decode; prefill passes the slots)

  replacing q_norm, k_norm, two rotary calls (with their cos/sin copies), two ``index_copy_``, the
  slot gather and ``Decoder._rope``'s dozen ops: cos/sin rows are read by position ``p`` from
  tables the runner builds once with ``Decoder._rope`` itself (so they are its values exactly).
  Without qk-norm (Llama) the norm is skipped. rmsnorm as :mod:`miles_core.kernels.rmsnorm`
  (statistic in fp32, normalised value rounded to the model dtype, times the weight); rotary as
  rotate-half (:mod:`miles_core.kernels.rope`) in fp32, rounded once.

``add_rmsnorm``   the residual add and the next norm, one program per row::

    x' = round(x + r);  h = w * round(x' * rsqrt(mean(x'^2) + eps))   -> (x', h)

  where ``r`` may also be a split-K GEMM's fp32 partials, summed here (``x + sum_s r_s``).

``merge_splits``  flash-decoding's merge of the attention splits (partial outputs and their
  log-sum-exps) in one kernel instead of eight torch ops.

Shapes: ``qkv`` [N, (H + 2 Hk) D] with unit last stride; ``positions`` [N] int64; cos/sin tables
[max_len, D]; caches [S, Hk, D]; ``slots`` [N] int64 or block tables [N, max_blocks] int32; ``x``/``r`` [N, hidden] contiguous. ``D`` a power of two.
"""

from __future__ import annotations

import torch

from miles_core.rollout.engine_core import triton_pdl
from miles_core.rollout.engine_core.triton_lib import available, tl, triton  # noqa: F401 (available: this module's API)


if triton is not None:
    from miles_core.rollout.engine_core.triton_pdl import pdl_wait

    @triton.jit
    def _norm_rope(base, W, cos, sin, eps, D: tl.constexpr, NORM: tl.constexpr):
        """Rows ``base[0:D]`` normalised (optionally) and rotated: the two halves, model dtype."""
        half = tl.arange(0, D // 2)
        x1 = tl.load(base + half)
        x2 = tl.load(base + D // 2 + half)
        if NORM:
            xf = tl.load(base + tl.arange(0, D)).to(tl.float32)  # the whole row: the norm kernel's sum
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
            x1 = (tl.load(W + half).to(tl.float32) * (x1.to(tl.float32) * rstd).to(x1.dtype).to(tl.float32)).to(x1.dtype)
            x2 = (tl.load(W + D // 2 + half).to(tl.float32) * (x2.to(tl.float32) * rstd).to(x2.dtype).to(tl.float32)).to(x2.dtype)
        c1 = tl.load(cos + half).to(tl.float32)
        c2 = tl.load(cos + D // 2 + half).to(tl.float32)
        s1 = tl.load(sin + half).to(tl.float32)
        s2 = tl.load(sin + D // 2 + half).to(tl.float32)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        return (a * c1 - b * s1).to(x1.dtype), (b * c2 + a * s2).to(x1.dtype)

    @triton.jit
    def _qkv_prologue_kernel(
        QKV, QW, KW, POS, COS, SIN, SLOTS, BT, KC, VC, QO, eps,
        s_qkv, s_bt, max_blocks, s_ct, s_ch, s_qo,
        H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, PAGE: tl.constexpr, HAS_SLOTS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)  # 0..H-1: query heads; H..H+HK-1: key/value heads
        half = tl.arange(0, D // 2)
        row = QKV + t.to(tl.int64) * s_qkv
        p = tl.load(POS + t)
        cos = COS + p * D
        sin = SIN + p * D
        if h < H:
            o1, o2 = _norm_rope(row + h * D, QW, cos, sin, eps, D, NORM)
            out = QO + t.to(tl.int64) * s_qo + h * D
            tl.store(out + half, o1)
            tl.store(out + D // 2 + half, o2)
        else:
            g = h - H
            o1, o2 = _norm_rope(row + h * D, KW, cos, sin, eps, D, NORM)
            if HAS_SLOTS:
                slot = tl.load(SLOTS + t).to(tl.int64)
            else:  # a position past the table (a padding row) reads its last page, as the torch path
                page = tl.load(BT + t.to(tl.int64) * s_bt + tl.minimum(p // PAGE, max_blocks - 1)).to(tl.int64)
                slot = page * PAGE + p % PAGE
            dst = slot * s_ct + g * s_ch
            tl.store(KC + dst + half, o1.to(KC.dtype.element_ty))
            tl.store(KC + dst + D // 2 + half, o2.to(KC.dtype.element_ty))
            cols = tl.arange(0, D)
            v = tl.load(row + (H + HK + g) * D + cols)
            tl.store(VC + dst + cols, v.to(VC.dtype.element_ty))

    @triton.jit
    def _add_rmsnorm_kernel(X, R, W, XO, HO, n, s_rs, eps, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * n + cols, mask=mask, other=0.0)
        r = tl.load(R + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        for i in tl.static_range(1, SPLITS):  # split-K partial sums of a GEMM: summed in order, in fp32
            r += tl.load(R + i * s_rs + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x.to(tl.float32) + r).to(x.dtype)  # the residual stream, rounded as torch's add
        tl.store(XO + row * n + cols, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / n + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = w * (sf * rstd).to(x.dtype).to(tl.float32)
        tl.store(HO + row * n + cols, y.to(HO.dtype.element_ty), mask=mask)

    @triton.jit
    def _merge_kernel(P, LSE, O, s_pb, s_ph, s_ps, s_lb, s_lh, s_ob, s_oh, SPLITS: tl.constexpr, SP: tl.constexpr, D: tl.constexpr,
                      PDL: tl.constexpr):
        pdl_wait(PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, SP)
        smask = s < SPLITS
        lse = tl.load(LSE + b * s_lb + h * s_lh + s, mask=smask, other=float("-inf"))
        top = tl.max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(lse - top)  # empty splits (lse = -inf) weigh 0
        cols = tl.arange(0, D)
        p = tl.load(P + b * s_pb + h * s_ph + s[:, None] * s_ps + cols[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(w[:, None] * p, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
        tl.store(O + b * s_ob + h * s_oh + cols, out.to(O.dtype.element_ty))


def supports(head_dim: int) -> bool:
    return triton is not None and head_dim >= 2 and head_dim & (head_dim - 1) == 0


def qkv_prologue(qkv, num_heads: int, num_kv_heads: int, head_dim: int, q_weight, k_weight, eps: float,
                 positions, cos_table, sin_table, k_cache, v_cache, slots=None, block_tables=None, page: int = 1,
                 pdl: bool = False) -> torch.Tensor:
    """Norm + rotary on q and k of the fused projection ``qkv``; writes k, v into the caches; returns q [N, H, D].

    ``q_weight``/``k_weight`` are the per-head RMSNorm weights [D], or both None (no qk-norm). The
    cache slots are ``slots``, or (decode, one row per sequence) found in ``block_tables`` with ``page``.
    ``pdl`` (here and below): launched as a programmatic dependent (:mod:`.triton_pdl`)."""
    n = qkv.shape[0]
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    norm = q_weight is not None
    has_slots = slots is not None
    dummy = positions  # an unread pointer
    bt = block_tables if block_tables is not None else dummy
    _qkv_prologue_kernel[(n, num_heads + num_kv_heads)](
        qkv, q_weight if norm else dummy, k_weight if norm else dummy, positions, cos_table, sin_table,
        slots if has_slots else dummy, bt, k_cache, v_cache, q, float(eps),
        qkv.stride(0), bt.stride(0) if not has_slots else 0, bt.shape[1] if not has_slots else 1,
        k_cache.stride(0), k_cache.stride(1), q.stride(0),
        H=num_heads, HK=num_kv_heads, D=head_dim, NORM=norm, PAGE=page, HAS_SLOTS=has_slots, PDL=pdl, num_warps=1,
        **triton_pdl.launch_opts(pdl),
    )
    return q


def add_rmsnorm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + r, rmsnorm(x + r, weight))`` for ``x`` [N, hidden], in one pass.

    ``r`` is [N, hidden], or [S, N, hidden] fp32 split-K partials of a GEMM (:mod:`.triton_gemm`):
    then ``x + sum_s r_s`` is taken in fp32 and rounded once (the GEMM output is never rounded)."""
    n, hidden = x.shape
    xo, ho = torch.empty_like(x), torch.empty_like(x)
    if n:
        r = r.contiguous()
        splits = r.shape[0] if r.dim() == 3 else 1
        block = triton.next_power_of_2(hidden)
        _add_rmsnorm_kernel[(n,)](x, r, weight, xo, ho, hidden, n * hidden, float(eps), SPLITS=splits, BLOCK=block, PDL=pdl,
                                  num_warps=max(1, min(8, block // 256)), **triton_pdl.launch_opts(pdl))
    return xo, ho


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """``partial`` [B, H, splits, D] fp32 and ``lse`` [B, H, splits] -> [B, H, D] in ``dtype``."""
    b, h, splits, d = partial.shape
    out = torch.empty(b, h, d, dtype=dtype, device=partial.device)
    if b:
        _merge_kernel[(b, h)](partial, lse, out, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
                              out.stride(0), out.stride(1), SPLITS=splits, SP=triton.next_power_of_2(splits), D=d, PDL=pdl,
                              **triton_pdl.launch_opts(pdl))
    return out
