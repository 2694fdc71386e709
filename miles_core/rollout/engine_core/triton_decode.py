"""Paged decode attention in Triton (flash-decoding over KV pages), for the GPU.

For each sequence ``b`` (one new query token, ``H`` heads in ``Hk`` groups of ``R = H / Hk``)::

    out[b, h] = softmax(q[b, h] . K[b, :ctx_b]^T / sqrt(D)) @ V[b, :ctx_b]

Grid ``(B, Hk, SPLITS)``: a program takes the ``R`` query heads of one KV head (so each K/V tile
is read once for the whole group) and one contiguous split of the context; it streams
``BLOCK_N`` tokens at a time, looking up each token's page in the block table, with an online
softmax (Milakov & Gimelshein 2018; Dao et al., FlashAttention, 2022). Splits write a partial
output and its log-sum-exp; :func:`paged_decode` merges them in one more kernel
(:func:`.triton_fused.merge_splits`; flash-decoding, Dao et al. 2023). With one split the kernel
writes the output in q's dtype. Context lengths are read from device memory, so the launch has static shapes and can be
captured in a CUDA graph. Departures: none in the math; the query group is padded to 16 rows
so that ``tl.dot`` can be used; with an fp32 cache the dots run in full fp32 (``input_precision="ieee"``), not tf32.

Shapes: ``q`` [B, H, D]; ``k_cache``/``v_cache`` [S, Hk, D]; ``block_tables`` [B, max_blocks]
int32; ``ctx_lens`` [B] int32/int64. Rows with ``ctx_lens == 0`` produce zeros.
"""

from __future__ import annotations

import math

import torch

from miles_core.rollout.engine_core import triton_fused, triton_pdl
from miles_core.rollout.engine_core.triton_lib import available, tl, triton  # noqa: F401 (available: this module's API)


if triton is not None:
    from miles_core.rollout.engine_core.triton_pdl import pdl_wait

    @triton.jit
    def _online_block(q, k, v, tmask, m, l, acc, scale, IEEE: tl.constexpr):
        """One block of the online softmax: scores of ``q`` against ``k`` (masked by ``tmask``), rescale, add ``p @ v``."""
        if IEEE:  # fp32 cache: full-precision dots (the default would round the inputs to tf32)
            scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee", out_dtype=tl.float32) * scale
        else:
            scores = tl.dot(q.to(k.dtype), tl.trans(k), out_dtype=tl.float32) * scale  # [REP_P, BLOCK_N]
        scores = tl.where(tmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee", out_dtype=tl.float32)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
        return m_new, l, acc

    @triton.jit
    def _attend(q, K, V, BT, b, kvh, start, end, scale, s_kt, s_kh, s_bt,
                PAGE: tl.constexpr, D: tl.constexpr, REP_P: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Online softmax of the query group ``q`` [REP_P, D] over cache positions ``[start, end)`` of
        sequence ``b``, KV head ``kvh`` -> (out [REP_P, D] fp32, log-sum-exp [REP_P]).

        Triton does not software-pipeline these gathered loads (page id, then the K/V rows); loading the
        next block before this block's math, by hand, was slower on the H200 (docs/benchmarks.md, session 12)."""
        offs_d = tl.arange(0, D)
        m = tl.full([REP_P], float("-inf"), tl.float32)
        l = tl.zeros([REP_P], tl.float32)
        acc = tl.zeros([REP_P, D], tl.float32)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            page = tl.load(BT + b * s_bt + t // PAGE, mask=tmask, other=0).to(tl.int64)
            slot = page * PAGE + t % PAGE
            kv_off = slot[:, None] * s_kt + kvh * s_kh + offs_d[None, :]
            k = tl.load(K + kv_off, mask=tmask[:, None], other=0.0)
            v = tl.load(V + kv_off, mask=tmask[:, None], other=0.0)
            m, l, acc = _online_block(q, k, v, tmask, m, l, acc, scale, IEEE)
        has = l > 0
        out = acc / tl.where(has, l, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        return out, lse

    @triton.jit
    def _split_range(ctx, s, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Split ``s``'s contiguous share ``[start, end)`` of a context of ``ctx`` tokens (whole blocks)."""
        per_split = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
        start = s * per_split
        return start, tl.minimum(start + per_split, ctx)

    @triton.jit
    def _decode_kernel(
        Q, K, V, BT, CTX, O, LSE, scale,
        s_qb, s_qh, s_kt, s_kh, s_bt, s_ob, s_oh, s_os, s_lb, s_lh,
        PAGE: tl.constexpr, D: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_wait(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        start, end = _split_range(tl.load(CTX + b).to(tl.int32), s, SPLITS, BLOCK_N)
        offs_h = tl.arange(0, REP_P)
        offs_d = tl.arange(0, D)
        hmask = offs_h < REP
        heads = kvh * REP + offs_h
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=hmask[:, None], other=0.0)
        out, lse = _attend(q, K, V, BT, b, kvh, start, end, scale, s_kt, s_kh, s_bt, PAGE, D, REP_P, BLOCK_N, IEEE)
        tl.store(O + b * s_ob + heads[:, None] * s_oh + s * s_os + offs_d[None, :], out.to(O.dtype.element_ty), mask=hmask[:, None])
        tl.store(LSE + b * s_lb + heads * s_lh + s, lse, mask=hmask)

    @triton.jit
    def _norm_rope_rows(rows, W, cos, sin, eps, mask, D: tl.constexpr, NORM: tl.constexpr):
        """Rows ``rows[:, None] + [0, D)`` (pointers [R]) normalised (optionally) and rotated
        (rotate-half), [R, D] in the model dtype: :func:`.triton_fused._norm_rope`'s math, the two
        halves side by side (element ``d`` pairs with ``d +- D/2``)."""
        d = tl.arange(0, D)
        pd = (d + D // 2) % D
        x = tl.load(rows[:, None] + d[None, :], mask=mask[:, None], other=0.0)
        xp = tl.load(rows[:, None] + pd[None, :], mask=mask[:, None], other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / D + eps)
            x = (tl.load(W + d).to(tl.float32)[None, :] * (xf * rstd[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
            xp = (tl.load(W + pd).to(tl.float32)[None, :] * (xp.to(tl.float32) * rstd[:, None]).to(xp.dtype).to(tl.float32)).to(xp.dtype)
        c = tl.load(cos + d).to(tl.float32)
        sn = tl.load(sin + d).to(tl.float32)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        return (x.to(tl.float32) * c[None, :] + sign[None, :] * xp.to(tl.float32) * sn[None, :]).to(x.dtype)

    @triton.jit
    def _decode_qkv_kernel(
        QKV, QW, KW, POS, COS, SIN, K, V, BT, CTX, O, LSE, scale, eps,
        s_qkv, s_kt, s_kh, s_bt, s_ob, s_oh, s_os, s_lb, s_lh,
        H: tl.constexpr, HK: tl.constexpr, NORM: tl.constexpr,
        PAGE: tl.constexpr, D: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    ):
        """:func:`.triton_fused.qkv_prologue` and :func:`_decode_kernel` in one program per (row, KV head,
        split): the group's q rows from the fused projection, normed and rotated in registers; the split
        that holds the new token's position writes its k (normed, rotated) and v into the cache, then
        waits at a CTA barrier so that its own loads below see them."""
        pdl_wait(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(CTX + b).to(tl.int32)
        start, end = _split_range(ctx, s, SPLITS, BLOCK_N)
        p = tl.load(POS + b)
        cos = COS + p * D
        sin = SIN + p * D
        row = QKV + b.to(tl.int64) * s_qkv
        offs_h = tl.arange(0, REP_P)
        offs_d = tl.arange(0, D)
        hmask = offs_h < REP
        heads = kvh * REP + offs_h
        q = _norm_rope_rows(row + heads * D, QW, cos, sin, eps, hmask, D, NORM)
        if (start <= ctx - 1) & (ctx - 1 < end):  # this split holds the new token: it writes its K/V
            one = offs_h < 1
            k = _norm_rope_rows(row + (H + kvh + offs_h * 0) * D, KW, cos, sin, eps, one, D, NORM)
            page = tl.load(BT + b * s_bt + (ctx - 1) // PAGE).to(tl.int64)
            dst = (page * PAGE + (ctx - 1) % PAGE) * s_kt + kvh * s_kh
            tl.store(K + dst + offs_h[:, None] * 0 + offs_d[None, :], k.to(K.dtype.element_ty), mask=one[:, None])
            v = tl.load(row + (H + HK + kvh) * D + offs_d)
            tl.store(V + dst + offs_d, v.to(V.dtype.element_ty))
        tl.debug_barrier()
        out, lse = _attend(q, K, V, BT, b, kvh, start, end, scale, s_kt, s_kh, s_bt, PAGE, D, REP_P, BLOCK_N, IEEE)
        tl.store(O + b * s_ob + heads[:, None] * s_oh + s * s_os + offs_d[None, :], out.to(O.dtype.element_ty), mask=hmask[:, None])
        tl.store(LSE + b * s_lb + heads * s_lh + s, lse, mask=hmask)


# The launch the engine uses (paged_decode's defaults): 64-token blocks over 4 warps, the fastest of 36
# launches at batch 64 and 256 on the H200 (benchmarks/decode_parts.py --parts attention, 2026-12-05:
# 20.3 / 70.1 µs per layer).
BLOCK_N = 64
NUM_WARPS = 4


def num_splits(batch: int, kv_heads: int, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU about twice: (B * Hk * splits) >= 2 * SMs, at most 32."""
    return max(1, min(32, math.ceil(2 * num_sms / max(1, batch * kv_heads))))


def _split_buffers(b: int, h: int, splits: int, d: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' outputs: one split writes the attention output in ``dtype`` directly; several write fp32
    partials [B, H, splits, D] and their log-sum-exps [B, H, splits], merged by :func:`_merged`."""
    partial = torch.empty(b, h, splits, d, device=device, dtype=dtype if splits == 1 else torch.float32)
    return partial, torch.empty(b, h, splits, device=device, dtype=torch.float32)


def _merged(partial: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, pdl: bool) -> torch.Tensor:
    if partial.shape[2] == 1:
        return partial[:, :, 0]
    return triton_fused.merge_splits(partial, lse, dtype, pdl)


def paged_decode(q, k_cache, v_cache, block_tables, ctx_lens, block_size: int, splits: int, block_n: int = BLOCK_N,
                 num_warps: int = NUM_WARPS, num_stages: int = 3, pdl: bool = False):
    """``q`` [B, H, D] -> [B, H, D] in q's dtype. See the module docstring. ``pdl``: launched (with the merge)
    as programmatic dependents (:mod:`.triton_pdl`)."""
    b, h, d = q.shape
    hk = k_cache.shape[1]
    rep = h // hk
    partial, lse = _split_buffers(b, h, splits, d, q.dtype, q.device)
    _decode_kernel[(b, hk, splits)](
        q, k_cache, v_cache, block_tables, ctx_lens, partial, lse, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        PAGE=block_size, D=d, REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), BLOCK_N=block_n, SPLITS=splits,
        IEEE=k_cache.dtype == torch.float32, PDL=pdl, num_warps=num_warps, num_stages=num_stages, **triton_pdl.launch_opts(pdl),
    )
    return _merged(partial, lse, q.dtype, pdl)


def paged_decode_qkv(qkv, num_heads: int, q_weight, k_weight, eps: float, positions, cos_table, sin_table, k_cache, v_cache,
                     block_tables, ctx_lens, block_size: int, splits: int, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                     num_stages: int = 3, pdl: bool = False):
    """:func:`.triton_fused.qkv_prologue` (decode form: slots from the block tables) followed by
    :func:`paged_decode`, in one kernel: ``qkv`` [B, (H + 2 Hk) D] -> attention output [B, H, D].
    Writes each row's new k/v at position ``ctx - 1`` (a row with ``ctx == 0``, padding, writes nothing).
    ``q_weight``/``k_weight``: the per-head RMSNorm weights, or both None (no qk-norm)."""
    b = qkv.shape[0]
    hk, d = k_cache.shape[1], k_cache.shape[2]
    rep = num_heads // hk
    partial, lse = _split_buffers(b, num_heads, splits, d, qkv.dtype, qkv.device)
    norm = q_weight is not None
    dummy = positions  # an unread pointer
    _decode_qkv_kernel[(b, hk, splits)](
        qkv, q_weight if norm else dummy, k_weight if norm else dummy, positions, cos_table, sin_table, k_cache, v_cache,
        block_tables, ctx_lens, partial, lse, 1.0 / math.sqrt(d), float(eps),
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        H=num_heads, HK=hk, NORM=norm, PAGE=block_size, D=d, REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), BLOCK_N=block_n,
        SPLITS=splits, IEEE=k_cache.dtype == torch.float32, PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        **triton_pdl.launch_opts(pdl),
    )
    return _merged(partial, lse, qkv.dtype, pdl)
