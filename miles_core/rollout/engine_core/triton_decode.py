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

try:  # triton is optional (the torch path is the reference)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    from miles_core.rollout.engine_core.triton_pdl import pdl_wait

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
        ctx = tl.load(CTX + b).to(tl.int32)
        per_split = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
        start = s * per_split
        end = tl.minimum(start + per_split, ctx)
        offs_h = tl.arange(0, REP_P)
        offs_d = tl.arange(0, D)
        hmask = offs_h < REP
        heads = kvh * REP + offs_h
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=hmask[:, None], other=0.0)
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
            m = m_new
        has = l > 0
        out = acc / tl.where(has, l, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(O + b * s_ob + heads[:, None] * s_oh + s * s_os + offs_d[None, :], out.to(O.dtype.element_ty), mask=hmask[:, None])
        tl.store(LSE + b * s_lb + heads * s_lh + s, lse, mask=hmask)


def num_splits(batch: int, kv_heads: int, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU about twice: (B * Hk * splits) >= 2 * SMs, at most 32."""
    return max(1, min(32, math.ceil(2 * num_sms / max(1, batch * kv_heads))))


def paged_decode(q, k_cache, v_cache, block_tables, ctx_lens, block_size: int, splits: int, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 3, pdl: bool = False):
    """``q`` [B, H, D] -> [B, H, D] in q's dtype. See the module docstring. ``pdl``: launched (with the merge)
    as programmatic dependents (:mod:`.triton_pdl`)."""
    b, h, d = q.shape
    hk = k_cache.shape[1]
    rep = h // hk
    # one split: the kernel writes the output in q's dtype directly; several: fp32 partials, merged
    partial = torch.empty(b, h, splits, d, device=q.device, dtype=q.dtype if splits == 1 else torch.float32)
    lse = torch.empty(b, h, splits, device=q.device, dtype=torch.float32)
    _decode_kernel[(b, hk, splits)](
        q, k_cache, v_cache, block_tables, ctx_lens, partial, lse, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        PAGE=block_size, D=d, REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), BLOCK_N=block_n, SPLITS=splits,
        IEEE=k_cache.dtype == torch.float32, PDL=pdl, num_warps=num_warps, num_stages=num_stages, **triton_pdl.launch_opts(pdl),
    )
    if splits == 1:
        return partial[:, :, 0]
    return triton_fused.merge_splits(partial, lse, q.dtype, pdl)
