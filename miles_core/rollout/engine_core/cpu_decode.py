"""The CPU decode window: ``K`` decode steps of a batch with as few torch ops per step as possible.

On CPU a small model's decode step is all host overhead (op dispatch, Python), not math: the
quickstart model (hidden 128, 2 layers) does a few microseconds of arithmetic per token. So this
path does, once per window, everything that does not depend on the tokens drawn in it, and
leaves each step only the model's own ops:

* the rows' K/V live in one contiguous buffer per layer, ``[B, Hk, cap, D]``: columns
  ``[0, used)`` hold each row's context (row ``b``'s valid columns are marked in an additive mask,
  0 or -inf), step ``j`` writes its new K/V into column ``used + j`` and attends over columns
  ``[0, used + j]``. The buffer is gathered from the pages when the batch changes, and kept for
  the next window while the same requests decode on (the common case: a batch of rollouts);
* the rotary tables, the per-step masks and the page slots of the ``K`` new tokens are built once
  per window; after its last step the new K/V go into the paged cache with one ``index_copy_``
  (the pages stay the truth: prefix sharing, preemption and the generic path read them).

Attention at step ``j``, row ``b``, head ``h`` (``g(h)`` its KV head), ``s = 1/sqrt(D)``::

    out = softmax(s * q K_win[b, g(h), :used+j+1]^T + mask[b]) V_win[b, g(h), :used+j+1]

one ``scaled_dot_product_attention`` call with ``enable_gqa`` (the query heads of a group share
their KV head without a copy). That is the function the paged path computes, up to rounding (the
masked columns add exact zeros; the summation order differs). Every norm, rotary and SwiGLU call
is the decoder's own kernel op, every projection the same (fused) weight, so engine and trainer
still compute the same function. Steps run under ``torch.inference_mode``.

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


class CpuDecoder:
    """Runs decode windows on CPU for one :class:`~.runner.ModelRunner`; keeps the last window's
    K/V buffer for the next window of the same requests."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.reset()

    def reset(self) -> None:
        """Forget the kept buffer (the KV cache was reallocated or released)."""
        self.rows: list = []  # the requests of the kept buffer, in row order
        self.next_pos: list[int] = []  # the position each row decodes next
        self.win: torch.Tensor | None = None  # [L, 2, B, Hk, cap, D]
        self.bias: torch.Tensor | None = None  # [B, cap] float32: 0 = column in the row's context, -inf = not
        self.used = 0

    # ------------------------------------------------------------------ the K/V buffer
    def _gather(self, pos0: torch.Tensor, block_tables: torch.Tensor, max_pos: int, steps: int) -> None:
        run, p = self.runner, self.runner.block_size
        b, hk, d, nl = pos0.shape[0], run.kv_heads, run.head_dim, run.num_layers
        t0 = max(p, -(-max_pos // p) * p)
        old = run.kv.index_select(2, gather_slots(block_tables, t0, p).flatten())  # [L, 2, B*T0, Hk, D]
        self.win = torch.empty(nl, 2, b, hk, _capacity(t0, steps), d, dtype=run.dtype)
        self.win[..., :t0, :].copy_(old.view(nl, 2, b, t0, hk, d).transpose(3, 4))
        self.bias = torch.zeros(b, self.win.shape[4])
        self.bias[:, :t0].masked_fill_(torch.arange(t0)[None, :] >= pos0[:, None], float("-inf"))
        self.used = t0

    def _ensure_room(self, steps: int) -> None:
        cap = self.win.shape[4]
        if self.used + steps <= cap:
            return
        new_cap = _capacity(self.used, steps)
        win = self.win.new_empty(*self.win.shape[:4], new_cap, self.win.shape[5])
        win[..., : self.used, :].copy_(self.win[..., : self.used, :])
        bias = self.bias.new_zeros(self.bias.shape[0], new_cap)
        bias[:, : self.used] = self.bias[:, : self.used]
        self.win, self.bias = win, bias

    # ------------------------------------------------------------------ one window
    @torch.inference_mode()
    def window(self, reqs: list, tokens: torch.Tensor, pos0: torch.Tensor, block_tables: torch.Tensor,
               steps: int, sample: Callable[[torch.Tensor, int], tuple]) -> WindowOut:
        """``reqs`` the requests in row order; ``tokens`` [B] int64 (each row's last sampled token,
        fed at position ``pos0`` [B] int64); ``block_tables`` [B, W] int32 (pages for positions up
        to ``pos0 + steps - 1``, or padding 0); ``sample(logits [B, V], j) -> (tok, logp, top)``."""
        run, model, p, k = self.runner, self.runner.model, self.runner.block_size, steps
        b, hk, d = tokens.shape[0], run.kv_heads, run.head_dim
        positions = [r.num_tokens - 1 for r in reqs]
        same = len(reqs) == len(self.rows) and all(x is y for x, y in zip(reqs, self.rows)) and positions == self.next_pos
        if not same:
            self._gather(pos0, block_tables, max(positions), k)
        self._ensure_room(k)
        t0, win = self.used, self.win
        # the window's positions, rotary tables, page slots and per-step masks [K, B, 1, 1, T0 + K]
        wpos = pos0[:, None] + torch.arange(k)  # [B, K]
        cos, sin = model._rope(wpos, run.dtype)  # [B, 1, K, D]
        col = (wpos // p).clamp(max=block_tables.shape[1] - 1)
        wslots = block_tables.gather(1, col).long() * p + wpos % p  # [B, K]
        new_cols = torch.zeros(k, k).masked_fill_(torch.ones(k, k, dtype=torch.bool).triu_(1), float("-inf"))  # step j sees new cols <= j
        masks = torch.cat([self.bias[:, :t0].expand(k, b, t0), new_cols[:, None, :].expand(k, b, k)], -1).view(k, b, 1, 1, t0 + k)

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
                qkv = F.linear(ln1.op(x, ln1.weight, ln1.eps), run.qkv[i])
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
                if run.is_moe:
                    routed.append(torch.full((b, run.moe_k), -1, dtype=torch.long))
                gu = run.gate_up[i]
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
        new = win[..., t0 : t0 + k, :].transpose(3, 4).reshape(run.num_layers, 2, b * k, hk, d)
        run.kv.index_copy_(2, wslots.flatten(), new)
        self.bias[:, t0 : t0 + k] = 0.0
        self.used = t0 + k
        self.rows, self.next_pos = list(reqs), [x + k for x in positions]
        return WindowOut(torch.stack(toks, 1), torch.stack(lps, 1), tops, routes)


def _capacity(used: int, steps: int) -> int:
    """Columns to allocate for ``used`` filled ones and ``steps`` more: room for several windows."""
    return used + steps + max(4 * steps, used // 2)
