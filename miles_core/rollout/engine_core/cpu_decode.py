"""The CPU decode window: ``K`` decode steps of a batch with as few torch ops per step as possible.

On CPU a small model's decode step is all host overhead (op dispatch, Python), not math: the
quickstart model (hidden 128, 2 layers) does a few microseconds of arithmetic per token. So this
path does, once per window, everything that does not depend on the tokens drawn in it, and
leaves each step only the model's own ops:

* the rows' K/V live in contiguous buffers per layer, K transposed ``[B, Hk, D, cap]`` and V
  ``[B, Hk, cap, D]`` (the operands of two batched matmuls as they are; with the fused C kernels
  below, K in blocks of 16 columns ``[B, Hk, cap / 16, D, 16]``): columns
  ``[0, used)`` hold each row's context (row ``b``'s valid columns are marked in an additive mask,
  0 or -inf, one row per (row, KV head); the columns past ``used`` are 0), step ``j`` writes its
  new K/V into column ``used + j`` and attends over columns ``[0, used + j]``. The buffer is
  gathered from the pages when the batch changes, sized for what the rows can still decode
  (prompt + max_new_tokens; at most the paged cache's slots per row, doubled when that is short),
  and kept for the next window while the same requests decode on (the common case: a batch of
  rollouts). With the fused kernels, which take each row's buffer row as an index, a request that
  finishes just leaves its row, and one that joins takes a free row with only its own context
  gathered (``_place``; where that context is longer than the buffer's filled columns, they are
  extended for every row first: ``_fill_to``); with the torch ops, the rows left are selected (``_keep_rows``) and a join
  gathers the buffer again;
* the rotary tables and the page slots of the ``K`` new tokens are built once per window (the fused
  kernels look both up themselves); after its last step the new K/V go into the paged cache with one
  ``index_copy_`` pair or one C call (the pages stay the truth: prefix sharing, preemption and the
  generic path read them).

Attention at step ``j``, row ``b``, head ``h`` (``g(h)`` its KV head), ``s = 1/sqrt(D)``::

    out = softmax(s * q K_win[b, g(h), :used+j+1]^T + mask[b]) V_win[b, g(h), :used+j+1]

as ``baddbmm`` (scale and mask folded into the GEMM) + softmax + ``bmm``, with the ``R = H / Hk``
query heads of a group as the rows of one matrix against their KV head (no copy of K/V per query
head). Measured against ``scaled_dot_product_attention(enable_gqa=True)`` on the same buffers: as
fast at B = 1, ~20% faster at B = 64. That is the function the paged path computes, up to
rounding (the masked columns add exact zeros; the summation order differs: logprobs within
~1e-6). Every norm, rotary and SwiGLU call is the decoder's own kernel op or a bit-identical
stand-in (below), every projection the same (fused) weight, so engine and trainer still compute
the same function. Steps run under ``torch.inference_mode``.

In fp32, where the model holds the reference norm / rotary / SwiGLU ops and head_dim is a multiple of
16, a step instead runs through the C kernels of :mod:`.cpu_native` (:mod:`.cpu_layers`). Where every layer
is a dense SwiGLU one, the weights are small (``cpu_layers.window_group``: the quickstart model's 1.6 MB) and
the draws are the C sampler's, the whole window is one call: rows in groups of 8, each group taken by one
thread through all ``K`` steps (layers, logits, draw), so its K/V stays in the cache from step to step. Else,
up to 128 rows of dense SwiGLU layers, all layers of a step in one call; else per layer the norm, q/k/v GEMM,
q/k norm + rotary + K/V column write + attention, o_proj, norm, gate/up + SwiGLU and down calls; the
C sampler where no row asks for a filter or top logprobs (:meth:`CpuDecoder.sampler`); and the
prefill (:meth:`CpuDecoder.prefill`). ``engine.cpu_kernels``, ``auto`` by default. Those sum in
another order than torch (rounding only); the torch ops stay the fallback.

A request that ends inside the window still computes to its end; its extra tokens' K/V land in
its own pages or the padding page 0 and are never read (as in the generic path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles_core.kernels.rmsnorm import rmsnorm_torch
from miles_core.kernels.rope import rope_torch
from miles_core.kernels.swiglu import swiglu_torch
from miles_core.rollout.engine_core import cpu_layers
from miles_core.rollout.engine_core.attention import AttnBatch, gather_slots
from miles_core.rollout.engine_core.cpu_native import KEY_BLOCK, MAX_HEAD_DIM, NativeKernels
from miles_core.rollout.engine_core.sampler import SamplingTensors, sample
from miles_core.rollout.engine_core.scheduler import final_len


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

    def __init__(self, runner, max_model_len: int, kernels: str = "auto") -> None:
        self.runner = runner
        self.max_model_len = max_model_len  # the engine's (a request's final length is bounded by it)
        self.kernels = kernels  # EngineConfig.cpu_kernels
        self._native: NativeKernels | None | bool = False  # loaded at the first window (False: not yet)
        if kernels == "native" and runner.device.type == "cpu":  # asked for: a build error shows at start-up
            self._native = NativeKernels.load(kernels)
        self.whole_window = True  # a window in one call where it runs (cpu_layers.window_group); False: step by step
        self.drop_statics()
        self.reset()

    def drop_statics(self) -> None:
        """Forget what :meth:`_window_statics` built (with the weights' panel copies): the weights are released."""
        self._statics_key: tuple = ((), ())  # (what _window_statics was built from, compared by identity; weight versions)
        self._statics: tuple = ()

    def reset(self) -> None:
        """Forget the kept buffer (the KV cache was reallocated or released)."""
        self.rows: list = []  # the requests of the kept buffer, in row order
        self.next_pos: list[int] = []  # the position each row decodes next
        # keys: [L, B, Hk, D, cap] transposed (the torch ops' batched matmul) or, with the fused kernels
        # (self.blocked), [L, B, Hk, cap / 16, D, 16] in blocks of 16 columns (read as one contiguous run)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None  # [L, B, Hk, cap, D]
        self.mask: torch.Tensor | None = None  # [B*Hk, 1, cap] additive: 0 = column in the row's context, -inf = not
        self.used = 0

    @property
    def blocked(self) -> bool:
        """Whether the kept keys are in the fused kernels' blocked layout (6-D) rather than transposed."""
        return self.k is not None and self.k.dim() == 6

    # ------------------------------------------------------------------ the K/V buffer
    def _gather(self, pos0: torch.Tensor, block_tables: torch.Tensor, max_pos: int, remaining: int, steps: int,
                blocked: bool) -> None:
        """Fill a new buffer with the rows' context (positions ``< pos0``), with room for
        ``remaining`` more columns (the most tokens any row can still decode) plus a window's
        overrun, as far as the memory budget allows: then one allocation serves the rows' whole
        generation (growing the buffer copies every column). The budget: the buffer holds no more
        token slots than the paged cache (``B * cap <= slots``), so it at most doubles KV memory.
        ``blocked``: the keys in blocks of 16 columns (cap a multiple of 16), for the fused kernels."""
        run, p = self.runner, self.runner.block_size
        b, hk, d, nl = pos0.shape[0], run.kv_heads, run.head_dim, run.num_layers
        t0 = max(p, -(-max_pos // p) * p)
        cap = t0 + max(steps, min(remaining, run.kv.shape[2] // b - t0)) + steps
        if blocked:  # the fused kernels' layout, filled by one C call (the kernels are loaded: blocked needs them)
            cap = -(-cap // KEY_BLOCK) * KEY_BLOCK
            self.k = torch.empty(nl, b, hk, cap // KEY_BLOCK, d, KEY_BLOCK, dtype=run.dtype)
            self.v = torch.empty(nl, b, hk, cap, d, dtype=run.dtype)
            self._native.gather(run.kv, block_tables.contiguous(), p, torch.arange(b), self.k, self.v, t0)
        else:
            old = run.kv.index_select(2, gather_slots(block_tables, t0, p).flatten())  # [L, 2, B*T0, Hk, D]
            old = old.view(nl, 2, b, t0, hk, d)
            self.k = torch.empty(nl, b, hk, d, cap, dtype=run.dtype)
            self.k[..., :t0].copy_(old[:, 0].permute(0, 1, 3, 4, 2))
            self.v = torch.empty(nl, b, hk, cap, d, dtype=run.dtype)
            self.v[..., :t0, :].copy_(old[:, 1].transpose(2, 3))
        self.mask = torch.zeros(b * hk, 1, cap, dtype=run.dtype)  # one row per (row, KV head)
        pad = (torch.arange(t0)[None, :] >= pos0[:, None])[:, None, :].expand(b, hk, t0).reshape(b * hk, 1, t0)
        self.mask[..., :t0].masked_fill_(pad, float("-inf"))
        self.used = t0

    def _place(self, reqs: list, positions: list[int], block_tables: torch.Tensor) -> list[int] | None:
        """With the fused kernels' layout, the buffer row of each request, which the kernels take as an index: a
        request already in the buffer where it left off keeps its row; one new to it (just prefilled, or resumed)
        takes a row that no request of ``reqs`` holds (one that has finished), its context gathered there from
        the pages and its mask row set (the filled columns first extended to its context where it is longer:
        :meth:`_fill_to`). None where that cannot be done (no buffer in this layout, or fewer free rows than new
        requests): the caller then gathers a new buffer. Rows that finish so cost no copy, and a request that joins costs only its own
        context."""
        if not self.blocked:
            return None
        where = {id(r): i for i, r in enumerate(self.rows) if r is not None}
        slots = [where.get(id(r), -1) for r in reqs]
        slots = [i if i >= 0 and self.next_pos[i] == n else -1 for i, n in zip(slots, positions)]
        new = [j for j, i in enumerate(slots) if i < 0]
        if not new:
            return slots
        free = sorted(set(range(len(self.rows))) - set(slots))
        if len(free) < len(new):
            return None
        self._fill_to(max(positions[j] for j in new))
        for j, i in zip(new, free):
            slots[j] = i
        run, hk = self.runner, self.runner.kv_heads
        rows = torch.tensor(new)
        self._native.gather(run.kv, block_tables.index_select(0, rows).contiguous(), run.block_size,
                            torch.tensor([slots[j] for j in new]), self.k, self.v, max(positions[j] for j in new))
        mask = self.mask.view(-1, hk, self.mask.shape[-1])
        for j in new:  # context [0, pos), then masked up to the filled columns; the window's columns after them
            mask[slots[j]] = 0.0
            mask[slots[j], :, positions[j] : self.used] = float("-inf")
        return slots

    def _fill_to(self, top: int) -> None:
        """Make the buffer's filled columns ``[0, top)`` when ``top`` is past them (a joining request's context is
        longer): the columns between are zeroed and masked for every row (they hold none of the rows' context), as a
        new buffer gathered for all rows would have them."""
        u = self.used
        if top <= u:
            return
        self._ensure_room(top - u)
        for c in range(u, top):  # keys in blocks of 16 columns: column c is lane c % 16 of block c // 16
            self.k[:, :, :, c // KEY_BLOCK, :, c % KEY_BLOCK] = 0.0
        self.v[:, :, :, u:top] = 0.0
        self.mask[..., u:top] = float("-inf")
        self.used = top

    def _keep_rows(self, reqs: list, positions: list[int]) -> bool:
        """Torch ops' layout: when ``reqs`` are some of the kept buffer's rows where they left off (others
        have finished: the common change of a batch of rollouts), select their rows from the buffer --
        contiguous blocks, no gather from the pages -- and return True."""
        where = {id(r): i for i, r in enumerate(self.rows)}
        keep = [where.get(id(r), -1) for r in reqs]
        if not reqs or min(keep) < 0 or any(self.next_pos[i] != n for i, n in zip(keep, positions)):
            return False
        idx = torch.tensor(keep)
        self.k, self.v = self.k.index_select(1, idx), self.v.index_select(1, idx)
        hk = self.runner.kv_heads
        self.mask = self.mask.view(-1, hk, self.mask.shape[-1]).index_select(0, idx).view(len(keep) * hk, 1, -1)
        self.rows, self.next_pos = list(reqs), list(positions)
        return True

    def _ensure_room(self, steps: int) -> None:
        """Grow the buffer (only when the memory budget cut its first size short): double it."""
        u = self.used
        if u + steps <= self.mask.shape[-1]:
            return
        cap = 2 * u + steps
        if self.blocked:
            cap, nbu = -(-cap // KEY_BLOCK) * KEY_BLOCK, -(-u // KEY_BLOCK)
            k = self.k.new_empty(*self.k.shape[:3], cap // KEY_BLOCK, *self.k.shape[4:])
            k[:, :, :, :nbu].copy_(self.k[:, :, :, :nbu])
        else:
            k = self.k.new_empty(*self.k.shape[:4], cap)
            k[..., :u].copy_(self.k[..., :u])
        v = self.v.new_empty(*self.v.shape[:3], cap, self.v.shape[4])
        v[..., :u, :].copy_(self.v[..., :u, :])
        mask = self.mask.new_zeros(*self.mask.shape[:2], cap)
        mask[..., :u] = self.mask[..., :u]
        self.k, self.v, self.mask = k, v, mask

    def _window_statics(self) -> tuple:
        """What every window uses and no token changes: the layer plans, the rotary
        tables of every position (``model._rope``, [P, 1, D]; sin with its first half negated for
        ``_rope_rolled``), the final norm, ``lm_head^T`` and the kernels' plan (its weight panels are copies).
        Rebuilt when the fused weight lists (:meth:`~.runner.ModelRunner.fuse`) or an op change, or a parameter
        changes in place (:func:`_versions`)."""
        run, model = self.runner, self.runner.model
        layers = model.model.layers
        versions = _versions(run)
        objs = (run.qkv, run.gate_up, model.lm_head.weight, *(layer.self_attn.rope for layer in layers))
        old, old_versions = self._statics_key
        if not (len(objs) == len(old) and all(a is b for a, b in zip(objs, old)) and versions == old_versions):
            d = run.head_dim
            rolled = all(layer.self_attn.rope is rope_torch for layer in layers)
            cos_t, sin_t = (t.contiguous() for t in model._rope(torch.arange(run.max_blocks * run.block_size), run.dtype))  # [P, 1, D]
            sin_plain = sin_t
            if rolled:
                sin_t = sin_t * torch.cat([-torch.ones(d // 2), torch.ones(d - d // 2)]).to(run.dtype)
            plan = [_layer_plan(run, i, layer, rolled) for i, layer in enumerate(layers)]
            fn = _norm(model.model.norm, run.dtype)
            self._statics = (plan, (cos_t, sin_t, sin_plain), fn, model.lm_head.weight.t(), self._native_plan(plan, fn, rolled))
            self._statics_key = (objs, versions)
        return self._statics

    def _native_plan(self, plan: list, final_norm: tuple, rolled: bool) -> list[cpu_layers.NativeLayer] | None:
        """Per layer what the fused kernels (cpu_native.c) take, or None where they cannot run this model:
        they need fp32, the reference RMSNorm and rotary ops, one qk-norm eps, and a head_dim that is a
        multiple of 16 up to MAX_HEAD_DIM. The MLP goes through the SwiGLU kernel when the layer's is the
        reference SwiGLU, else through the layer's own ops (MoE). The GEMM weights get their panel copies
        where :func:`.cpu_layers.with_panels` makes them."""
        run = self.runner
        if (self._lib() is None or run.dtype != torch.float32 or not rolled or run.head_dim % 16
                or run.head_dim > MAX_HEAD_DIM or final_norm[0] is not _rms_norm_fp32 or not final_norm[1].is_contiguous()):
            return None
        out = []
        for ln1, qkv_w, _rope, qk_norm, o_w, ln2, mlp, gate_up, act, down_w in plan:
            norms = (ln1, ln2, *(qk_norm or ()))
            if (any(n[0] is not _rms_norm_fp32 or not n[1].is_contiguous() for n in norms)
                    or (qk_norm and qk_norm[0][2] != qk_norm[1][2])):
                return None
            qw, kw, qk_eps = (qk_norm[0][1], qk_norm[1][1], qk_norm[0][2]) if qk_norm else (None, None, 0.0)
            out.append(cpu_layers.NativeLayer(ln1[1], ln1[2], qkv_w, qw, kw, qk_eps, o_w, ln2[1], ln2[2],
                                              (mlp, gate_up, act, down_w), gate_up is not None and act is swiglu_torch))
        return cpu_layers.with_panels(self._native, out)

    def _lib(self) -> NativeKernels | None:
        """The fused kernels, loaded at the first use (None: ``cpu_kernels="torch"``, or they did not build)."""
        if self._native is False:
            self._native = NativeKernels.load(self.kernels)
        return self._native

    def sampler(self, st: SamplingTensors, counters: torch.Tensor) -> Callable[[torch.Tensor, int], tuple]:
        """The window's ``sample(logits, j)`` for rows with sampling tensors ``st`` whose step-0 tokens are output
        position ``counters`` [B]: the C sampler (:class:`NativeDraw`, the same draws as
        :func:`.sampler.sample_torch`) where no row asks for a filter or top logprobs, else ``sampler.sample``."""
        nat = self._lib()
        if nat is None or st.any_top_p_or_k or st.any_min_p or st.max_top_logprobs:
            return lambda z, j: sample(z, st, counters + j)
        return NativeDraw(nat, st, counters.contiguous())

    # ------------------------------------------------------------------ prefill
    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, meta: AttnBatch,
                logits_index: torch.Tensor) -> tuple | None:
        """:meth:`.runner.ModelRunner.prefill` through the fused kernels (:func:`.cpu_layers.prefill`), or
        None where they do not run this model (the caller then takes the runner's)."""
        if not supported(self.runner) or self.kernels == "torch":
            return None
        _, (cos_t, _, sin_plain), fn, head_w, nplan = self._window_statics()
        if nplan is None:
            return None
        return cpu_layers.prefill(self._native, nplan, self.runner, (cos_t, sin_plain), fn, head_w, input_ids, positions,
                                  slots, meta, logits_index)

    # ------------------------------------------------------------------ one window
    @torch.inference_mode()
    def window(self, reqs: list, tokens: torch.Tensor, pos0: torch.Tensor, block_tables: torch.Tensor,
               steps: int, sample: Callable[[torch.Tensor, int], tuple]) -> WindowOut:
        """``reqs`` the requests in row order; ``tokens`` [B] int64 (each row's last sampled token,
        fed at position ``pos0`` [B] int64); ``block_tables`` [B, W] int32 (pages for positions up
        to ``pos0 + steps - 1``, or padding 0); ``sample(logits [B, V], j) -> (tok, logp, top)``."""
        run, model, p, k = self.runner, self.runner.model, self.runner.block_size, steps
        b, hk, d = tokens.shape[0], run.kv_heads, run.head_dim
        plan, (cos_t, sin_t, sin_plain), fn, head_w, nplan = self._window_statics()
        blocked = nplan is not None  # the fused kernels' key layout
        positions = [r.num_tokens - 1 for r in reqs]
        if blocked:
            slots = self._place(reqs, positions, block_tables)
        else:
            same = len(reqs) == len(self.rows) and all(x is y for x, y in zip(reqs, self.rows)) and positions == self.next_pos
            slots = list(range(b)) if not self.blocked and (same or self._keep_rows(reqs, positions)) else None
        if slots is None:
            remaining = max(final_len(r, self.max_model_len) - n for r, n in zip(reqs, positions))
            self._gather(pos0, block_tables, max(positions), remaining, k, blocked)
            slots = list(range(b))
        self._ensure_room(k)
        t0, kt, vw = self.used, self.k, self.v
        if nplan is not None:  # the kernels read the rotary tables at row pos0 + j and find the page slots themselves
            pos0 = pos0.contiguous()
        else:  # the window's positions, rotary tables and page slots
            wpos = pos0[:, None] + torch.arange(k)  # [B, K]
            cos, sin = cos_t[wpos].transpose(1, 2), sin_t[wpos].transpose(1, 2)  # [B, 1, K, D]
            cos, sin = cos.split(1, 2), sin.split(1, 2)  # per step [B, 1, 1, D]
            col = (wpos // p).clamp(max=block_tables.shape[1] - 1)
            wslots = block_tables.gather(1, col).long() * p + wpos % p  # [B, K]
        fp32 = run.dtype == torch.float32  # else the softmax runs in fp32 (as the generic path's does)

        mc = model.config
        h, rep, scale = mc.num_heads, mc.num_heads // mc.num_kv_heads, d**-0.5
        nq, nk = h * d, hk * d
        embed = model.model.embed_tokens.weight
        if nplan is not None:  # the kernels' output buffers ([B, hidden], [B, H D], [B, I]); per layer K, V
            # the kernels take raw pointers: every buffer they index must be contiguous
            assert kt.is_contiguous() and vw.is_contiguous() and self.mask.is_contiguous()
            nat, mask2d, k_l, v_l = self._native, self.mask.view(-1, self.mask.shape[-1]), kt.unbind(0), vw.unbind(0)
            slot_t = torch.tensor(slots)  # row b's K/V and mask: buffer row slots[b]
            bufs, o_buf = cpu_layers.buffers(nplan, b, embed.shape[1]), torch.empty(b, nq)
            own_gemm = cpu_layers.gemm_ok(nplan, b)
            # the whole window in one call (cpu_native.c's miles_decode_window) where the weights are small and the draws
            # are the C sampler's; else the whole step in one call (miles_decode_step); both where every layer is a dense
            # SwiGLU one
            step_args = cpu_layers.step_args(nplan, k_l, v_l) if embed.is_contiguous() else None
            group = (cpu_layers.window_group(nplan, b, head_w.t())
                     if step_args is not None and isinstance(sample, NativeDraw) and self.whole_window else 0)
            whole = step_args if own_gemm or group else None
            x_buf, xn_buf = torch.empty(b, embed.shape[1]), torch.empty(b, embed.shape[1])
        else:  # per layer, views made once per window (indexing costs as much as a small op):
            whole, group = None, 0
            # K [B*Hk, D, cap] and V [B*Hk, cap, D] for the batched matmuls
            k_mm = [x.view(b * hk, d, -1) for x in kt.unbind(0)]
            v_mm = [x.view(b * hk, -1, d) for x in vw.unbind(0)]
        toks, lps, tops, routes = [], [], [], []
        tok = tokens
        if group:  # the whole window in one call: each row group through every step, drawn inside it
            st = sample.st
            out = nat.decode_window(tok.contiguous(), embed, *whole, fn[1:], head_w.t(), cos_t, sin_plain, pos0, slot_t, mask2d,
                                    t0, scale, st.temperature, st.seeds, sample.counters, k, group, h, hk, d, bufs[1].shape[1])
        for j in range(0 if group else k):  # else step by step
            routed = []
            if whole is not None:  # embedding, layers and final norm in one call
                xn = nat.decode_step(tok.contiguous(), embed, x_buf, *whole, fn[1:], xn_buf, cos_t, sin_plain, pos0, j, slot_t,
                                     mask2d, t0 + j, scale, bufs, o_buf, h, hk)
            elif nplan is not None:  # the same kernels call by call (MoE layers, or more than GEMM_ROWS rows)
                def attend(i, qkv, q_w, k_w, qk_eps, j=j):  # column t0 + j gets the new K/V
                    return nat.attn_step(qkv, cos_t, sin_plain, q_w, k_w, qk_eps, k_l[i], v_l[i], mask2d, o_buf, h, t0 + j, scale,
                                         pos0, j, slot_t)

                x = cpu_layers.native_layers(nat, nplan, F.embedding(tok, embed), attend, bufs, run, routed, own_gemm)
                xn = nat.rmsnorm(x, fn[1], fn[2], bufs[0])
            else:
                x, c, s = F.embedding(tok, embed), cos[j], sin[j]
                end = t0 + j + 1
                mask = self.mask.narrow(2, 0, end)  # the window's own columns t0..t0+j are 0 (in context)
                k_col, v_col = kt.select(4, t0 + j), vw.select(3, t0 + j)  # [L, B, Hk, D]: this step's column
                for i, (ln1, qkv_w, rope, qk_norm, o_w, ln2, mlp, gate_up, act, down_w) in enumerate(plan):
                    qkv = torch.mm(ln1[0](x, ln1[1], ln1[2]), qkv_w)
                    if qk_norm is None:  # one rotary call over the query and key heads together
                        qk = rope(qkv[:, : nq + nk].view(b, h + hk, 1, d), c, s)
                        q, kk = qk[:, :h], qk[:, h:]
                    else:
                        (qn, qw, qe), (kn, kw, ke) = qk_norm
                        q = rope(qn(qkv[:, :nq].view(b, h, d), qw, qe).view(b, h, 1, d), c, s)
                        kk = rope(kn(qkv[:, nq : nq + nk].view(b, hk, d), kw, ke).view(b, hk, 1, d), c, s)
                    k_col[i].copy_(kk.view(b, hk, d))
                    v_col[i].copy_(qkv[:, nq + nk :].view(b, hk, d))
                    scores = torch.baddbmm(mask, q.reshape(b * hk, rep, d), k_mm[i].narrow(2, 0, end), alpha=scale)  # [B*Hk, R, end]
                    probs = torch.softmax(scores, -1) if fp32 else torch.softmax(scores, -1, dtype=torch.float32).to(run.dtype)
                    o = torch.bmm(probs, v_mm[i].narrow(1, 0, end))  # [B*Hk, R, D]
                    x = x + torch.mm(o.view(b, nq), o_w)
                    x = cpu_layers.mlp_residual(x, ln2[0](x, ln2[1], ln2[2]), mlp, gate_up, act, down_w, run, routed)
                xn = fn[0](x, fn[1], fn[2])
            logits = cpu_layers.logits(self._native if nplan is not None else None, xn, head_w)
            tok, lp, top = sample(logits, j)
            toks.append(tok)
            lps.append(lp)
            if top is not None:
                tops.append(top)
            if routed:
                routes.append(torch.stack(routed, 1))
        # the window's new K/V into the paged cache: [L, B, Hk, .., K, ..] -> [L, B*K, Hk, D] at slots [B*K]
        if self.blocked:  # one C call copies the columns t0 .. t0+k-1 of every layer, row and KV head
            self._native.write_back(kt, vw, run.kv, block_tables.contiguous(), p, pos0, slot_t, t0, k)
        else:
            nl, flat = run.num_layers, wslots.flatten()
            keys = kt[..., t0 : t0 + k].permute(0, 1, 4, 2, 3)
            run.kv[:, 0].index_copy_(1, flat, keys.reshape(nl, b * k, hk, d))
            run.kv[:, 1].index_copy_(1, flat, vw[..., t0 : t0 + k, :].transpose(2, 3).reshape(nl, b * k, hk, d))
        self.used = t0 + k  # mask columns past the old `used` are 0 already: these are now context
        if self.blocked:  # per buffer row: its request (None: free) and the position it decodes next
            self.rows, self.next_pos = [None] * kt.shape[1], [0] * kt.shape[1]
            for r, i, n in zip(reqs, slots, positions):
                self.rows[i], self.next_pos[i] = r, n + k
        else:
            self.rows, self.next_pos = list(reqs), [x + k for x in positions]
        if not group:
            out = (torch.stack(toks, 1), torch.stack(lps, 1))
        return WindowOut(*out, tops, routes)


class NativeDraw:
    """``sample(logits, j)`` through the C sampler (:meth:`.cpu_native.NativeKernels.sample`): rows with no filter and
    no top logprobs, whose step-0 tokens are output position ``counters`` [B]. The window hands its tensors to
    :meth:`.cpu_native.NativeKernels.decode_window` when it draws inside that call."""

    def __init__(self, nat: NativeKernels, st: SamplingTensors, counters: torch.Tensor) -> None:
        self.nat, self.st, self.counters = nat, st, counters

    def __call__(self, z: torch.Tensor, j: int) -> tuple:
        if z.dtype != torch.float32:
            return sample(z, self.st, self.counters + j)
        return (*self.nat.sample(z, self.st.temperature, self.st.seeds, self.counters, j), None)


def _versions(run) -> tuple[int, ...]:
    """The parameters' version counters: an in-place change of a parameter (``update_weights``' ``copy_``, an
    ``add_``) bumps its own. (Not the fused tensors': a parameter rebound by ``.data =`` to a view of one keeps a
    counter of its own.)"""
    return tuple(p._version for p in run.model.parameters())


def _layer_plan(run, i: int, layer, rolled: bool) -> tuple:
    """What step ``j`` calls for layer ``i``, looked up once per window (module attribute access
    costs as much as a small op): (norm op, weight, eps) triples, the ops, and the projection
    weights as transposed views ``W^T`` [in, out], for ``torch.mm(x, W^T)``: the very GEMM
    ``F.linear(x, W)`` makes for a 2-D ``x`` without bias, minus its ``t()`` call each step."""
    a, mlp, dt = layer.self_attn, layer.mlp, run.dtype
    qk_norm = (_norm(a.q_norm, dt), _norm(a.k_norm, dt)) if a.cfg.qk_norm else None
    gate_up = run.gate_up[i].t() if run.gate_up and not run.is_moe else None
    down = mlp.down_proj.weight.t() if gate_up is not None else None
    rope = _rope_rolled if rolled else a.rope
    return (_norm(layer.input_layernorm, dt), run.qkv[i].t(), rope, qk_norm, a.o_proj.weight.t(),
            _norm(layer.post_attention_layernorm, dt), mlp, gate_up, getattr(mlp, "act", None), down)


# Bit-identical stand-ins for the reference ops, with fewer torch calls (tests/rollout/test_cpu_decode.py
# checks the bits): the window calls them only where the model holds the reference op.
def _norm(m, dtype: torch.dtype) -> tuple:
    """(op, weight, eps) of an RMSNorm; fp32 with the reference op: torch's fused ``F.rms_norm``,
    which computes ``x * rsqrt(mean(x^2) + eps) * weight`` in the same order, to the same bits."""
    op = _rms_norm_fp32 if m.op is rmsnorm_torch and dtype == torch.float32 else m.op
    return op, m.weight, m.eps


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rope_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``rope_torch`` with ``sin_signed = (-sin_1, sin_2)`` (halves): ``(-x2, x1) * sin == roll(x) *
    sin_signed`` exactly (negation commutes with rounding), one roll instead of two slices, a
    negation and a cat."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
