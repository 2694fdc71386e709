"""Attention over the paged KV cache, in plain torch (the reference, and the CPU path).

Shapes: ``N`` new tokens in the step (flat), ``B`` sequences, ``H`` query heads, ``Hk`` KV heads,
``D`` head dim, ``S`` cache slots (``num_blocks * block_size``).

* ``k_cache``/``v_cache`` [S, Hk, D]; token ``t`` of sequence ``b`` sits in slot
  ``block_tables[b, t // P] * P + t % P`` (``P`` = block size).
* Sequence ``b`` brings ``q_len[b]`` new tokens, whose K/V are already written; after them it has
  ``ctx_len[b]`` tokens in the cache. Its ``i``-th new token is at position
  ``ctx_len[b] - q_len[b] + i`` and attends to cache positions ``<=`` that (causal), and with a
  sliding ``window`` ``w`` only to positions ``> pos - w`` (transformers' convention).
* ``scale``: the score scale, ``1/sqrt(D)`` when None (a model may set its own: Gemma, Granite).

Method: gather each sequence's K/V into a padded [B, T, Hk, D] block, then one
``scaled_dot_product_attention`` with a boolean mask, the same call the training decoder makes
(grouped-query heads expanded with ``repeat_interleave``), so logprobs agree with the trainer's to
rounding. The gather costs an extra copy of the K/V it reads; on GPU decode uses the Triton
kernel in ``triton_decode.py`` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnBatch:
    """Per-step attention metadata (device tensors unless said otherwise)."""

    block_tables: torch.Tensor  # [B, max_blocks] int32/int64
    ctx_lens: torch.Tensor  # [B] int64
    q_index: torch.Tensor  # [N] int64, flat token -> row*Qmax + i in the padded query block
    q_pos: torch.Tensor  # [B, Qmax] int64, position of each padded query (-1 for padding)
    num_seqs: int
    max_q: int  # Qmax (host int)
    max_ctx: int  # T, a multiple of the block size (host int)
    # prefill only, when every chunk starts at position 0 (no cached context): [B + 1] int32 start
    # offsets of the sequences in the flat batch, for the flash varlen path (runner.prefill)
    cu_seqlens: torch.Tensor | None = None


def gather_slots(block_tables: torch.Tensor, max_ctx: int, block_size: int) -> torch.Tensor:
    """[B, max_ctx] slot index of each cache position (positions past a row's pages point to page 0)."""
    nb = max_ctx // block_size
    pages = block_tables[:, :nb].long()
    offs = torch.arange(block_size, device=pages.device)
    return (pages[:, :, None] * block_size + offs).reshape(pages.shape[0], nb * block_size)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnBatch, block_size: int,
                    scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """``q`` [N, H, D] -> [N, H, D]."""
    n, h, d = q.shape
    b, qmax, t = meta.num_seqs, meta.max_q, meta.max_ctx
    slots = gather_slots(meta.block_tables[:b], t, block_size)  # [B, T]
    k = k_cache[slots].transpose(1, 2)  # [B, Hk, T, D]
    v = v_cache[slots].transpose(1, 2)
    rep = h // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    qp = q.new_zeros(b * qmax, h, d)
    qp[meta.q_index] = q
    qp = qp.view(b, qmax, h, d).transpose(1, 2)  # [B, H, Qmax, D]
    kpos = torch.arange(t, device=q.device)
    mask = (kpos[None, None, :] <= meta.q_pos[:, :, None]) & (kpos[None, None, :] < meta.ctx_lens[:b, None, None])
    if window is not None:
        mask = mask & (kpos[None, None, :] > meta.q_pos[:, :, None] - window)
    mask = mask | ((meta.q_pos[:, :, None] < 0) & (kpos == 0))  # padding queries see slot 0 (no NaN)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2).reshape(b * qmax, h, d)[meta.q_index]


def decode_attention_torch(q, k_cache, v_cache, block_tables, ctx_lens, block_size: int, max_ctx: int) -> torch.Tensor:
    """Decode (one new token per row): ``q`` [B, H, D] -> [B, H, D]; static shapes (graph-safe).

    ``softmax(q K^T / sqrt(D)) V`` per row over its first ``ctx_lens[b]`` cache positions, with the
    ``R = H / Hk`` query heads of a group sharing one gathered K/V (no ``repeat_interleave``).
    """
    b, h, d = q.shape
    hk = k_cache.shape[1]
    slots = gather_slots(block_tables, max_ctx, block_size).flatten()
    # [B*T, Hk, D] -> [B, Hk, T, D] contiguous: one copy each, then batched matmuls
    k = k_cache.index_select(0, slots).view(b, max_ctx, hk, d).transpose(1, 2).contiguous()
    v = v_cache.index_select(0, slots).view(b, max_ctx, hk, d).transpose(1, 2).contiguous()
    qg = q.view(b, hk, h // hk, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(d))  # [B, Hk, R, T]
    kpos = torch.arange(max_ctx, device=q.device)
    mask = (kpos[None, :] < ctx_lens[:, None]) | (kpos[None, :] == 0)  # rows with ctx 0 (padding) see slot 0
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, -1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, h, d)
