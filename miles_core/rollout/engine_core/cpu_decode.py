"""The CPU decode window: ``K`` decode steps of a batch with as few torch ops per step as possible.

On CPU a small model's decode step is all host overhead (op dispatch, Python), not math: the
quickstart model (hidden 128, 2 layers) does a few microseconds of arithmetic per token. So this
path does, once per window, everything that does not depend on the tokens drawn in it, and
leaves each step only the model's own ops:

* the rows' cached K/V are gathered once into one contiguous buffer per layer,
  ``[B, Hk, T0 + K, D]`` (``T0`` = the longest context rounded up to a page); step ``j`` writes
  its new K/V into column ``T0 + j`` and attends over columns ``[0, T0 + j]``;
* the rotary tables, the attention masks (``col < pos0[b]`` or ``T0 <= col <= T0 + j``) and the
  page slots of the ``K`` new tokens are built once for the window;
* after the last step the window's new K/V go into the paged cache with one ``index_copy_``.

Attention at step ``j``, row ``b``, head ``h`` (``g(h)`` its KV head), ``s = 1/sqrt(D)``::

    out = softmax(s * q K_win[b, g(h), cols]^T  masked to the valid cols) V_win[b, g(h), cols]

one ``scaled_dot_product_attention`` call with ``enable_gqa`` (the query heads of a group share
their KV head without a copy). That is the function the paged path computes, to rounding (a
different summation order); greedy tokens and logprobs match transformers as before (tests in
``tests/rollout/test_cpu_decode.py``). Every norm, rotary and SwiGLU call is the decoder's own
kernel op, every projection the same (fused) weight, so engine and trainer compute the same
function. Steps run under ``torch.inference_mode`` (no autograd bookkeeping per op).

A request that ends inside the window still computes to its end; its extra tokens' K/V land in
its own pages or the padding page 0 and are never read (as in the generic path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_core.rollout.engine_core.attention import gather_slots


@dataclass
class WindowOut:
    tokens: torch.Tensor  # [B, K] int64
    logprobs: torch.Tensor  # [B, K] float32
    tops: list  # per step (values [B, k], ids [B, k]) when top logprobs were asked, else empty
    routes: list  # per step [B, L, k] (MoE), else empty


def supported(runner) -> bool:
    """The window needs the fused q/k/v weights (plain bias-free projections) and the eager path."""
    return runner.device.type == "cpu" and not runner.cfg.exact_attention and bool(runner.qkv)


@torch.inference_mode()
def decode_window(
    runner,
    tokens: torch.Tensor,
    pos0: torch.Tensor,
    block_tables: torch.Tensor,
    max_pos: int,
    steps: int,
    sample: Callable[[torch.Tensor, int], tuple],
) -> WindowOut:
    """``tokens`` [B] int64 (each row's last sampled token, fed at position ``pos0`` [B] int64),
    ``block_tables`` [B, W] int32 (pages for positions up to ``pos0 + steps - 1`` or padding 0),
    ``max_pos`` = ``max(pos0)`` as a host int, ``sample(logits [B, V], j) -> (tok, logp, top)``."""
    model, p = runner.model, runner.block_size
    b, hk, d, k = tokens.shape[0], runner.kv_heads, runner.head_dim, steps
    t0 = max(p, -(-max_pos // p) * p)
    # the rows' context, one gather for every layer's K and V: [L, 2, B, Hk, T0 + K, D]
    old = runner.kv.index_select(2, gather_slots(block_tables, t0, p).flatten())
    win = torch.empty(runner.num_layers, 2, b, hk, t0 + k, d, dtype=runner.dtype)
    win[..., :t0, :].copy_(old.view(runner.num_layers, 2, b, t0, hk, d).transpose(3, 4))
    # the window's positions, their rotary tables, page slots and per-step masks
    wpos = pos0[:, None] + torch.arange(k)  # [B, K]
    cos, sin = model._rope(wpos, runner.dtype)  # [B, 1, K, D]
    col = (wpos // p).clamp(max=block_tables.shape[1] - 1)
    wslots = block_tables.gather(1, col).long() * p + wpos % p  # [B, K]
    cols = torch.arange(t0 + k)
    step_cols = (cols >= t0) & (cols <= t0 + torch.arange(k)[:, None])  # [K, T0 + K]
    masks = ((cols[None, :] < pos0[:, None])[None] | step_cols[:, None]).view(k, b, 1, 1, t0 + k)

    layers = model.model.layers
    mc = model.config
    h, rep = mc.num_heads, mc.num_heads // mc.num_kv_heads
    nq, nk = h * d, hk * d
    embed, final_norm, head_w = model.model.embed_tokens.weight, model.model.norm, model.lm_head.weight
    toks, lps, tops, routes = [], [], [], []
    tok = tokens
    for j in range(k):
        c, s = cos[:, :, j : j + 1], sin[:, :, j : j + 1]  # [B, 1, 1, D]
        end = t0 + j + 1
        mask = masks[j][..., :end]
        x = F.embedding(tok, embed)
        routed = []
        for i, layer in enumerate(layers):
            a, ln1 = layer.self_attn, layer.input_layernorm
            qkv = F.linear(ln1.op(x, ln1.weight, ln1.eps), runner.qkv[i])
            v = qkv[:, nq + nk :].view(b, hk, 1, d)
            if a.cfg.qk_norm:
                q = a.q_norm.op(qkv[:, :nq].view(b, h, d), a.q_norm.weight, a.q_norm.eps).view(b, h, 1, d)
                kk = a.k_norm.op(qkv[:, nq : nq + nk].view(b, hk, d), a.k_norm.weight, a.k_norm.eps).view(b, hk, 1, d)
                q, kk = a.rope(q, c, s), a.rope(kk, c, s)
            else:  # one rotary call over the query and key heads together
                qk = a.rope(qkv[:, : nq + nk].view(b, h + hk, 1, d), c, s)
                q, kk = qk[:, :h], qk[:, h:]
            win[i, 0, :, :, t0 + j] = kk[:, :, 0]
            win[i, 1, :, :, t0 + j] = v[:, :, 0]
            o = F.scaled_dot_product_attention(q, win[i, 0, :, :, :end], win[i, 1, :, :, :end], attn_mask=mask, enable_gqa=rep > 1)
            x = x + F.linear(o.view(b, nq), a.o_proj.weight)
            ln2, mlp = layer.post_attention_layernorm, layer.mlp
            hn = ln2.op(x, ln2.weight, ln2.eps)
            if hasattr(mlp, "route"):
                ids, w = mlp.route(hn)
                routed.append(ids)
                x = x + mlp.combine(hn, ids, w)
                continue
            if runner.is_moe:
                routed.append(torch.full((b, runner.moe_k), -1, dtype=torch.long))
            gu = runner.gate_up[i]
            if gu is None:
                x = x + mlp(hn)
            else:
                gate, up = F.linear(hn, gu).chunk(2, -1)
                x = x + F.linear(mlp.act(gate, up), mlp.down_proj.weight)
        logits = F.linear(final_norm.op(x, final_norm.weight, final_norm.eps), head_w)
        tok, lp, top = sample(logits, j)
        toks.append(tok)
        lps.append(lp)
        if top is not None:
            tops.append(top)
        if routed:
            routes.append(torch.stack(routed, 1))
    # the window's new K/V into the paged cache: [L, 2, B, Hk, K, D] -> slots [B * K]
    new = win[..., t0:, :].transpose(3, 4).reshape(runner.num_layers, 2, b * k, hk, d)
    runner.kv.index_copy_(2, wslots.flatten(), new)
    return WindowOut(torch.stack(toks, 1), torch.stack(lps, 1), tops, routes)
