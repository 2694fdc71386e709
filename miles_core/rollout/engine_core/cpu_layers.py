"""The model's layers on CPU through the fp32 kernels of :mod:`.cpu_native`: one decode step of the window
(:mod:`.cpu_decode`) and a whole prefill.

Each layer is RMSNorm, the q/k/v GEMM, the attention with its prologue (q/k norm, rotary, K/V write), the o_proj
GEMM adding the residual, RMSNorm, the gate/up GEMM with SwiGLU, and the down GEMM adding the residual. Up to
``GEMM_ROWS`` rows the GEMMs are cpu_native.c's (SwiGLU and the residual in their epilogues; the weights read from
their panel copies, :func:`with_panels`, where there are); above, MKL's
(``torch.mm`` / ``addmm``) with a SwiGLU kernel. A MoE layer's MLP runs through the layer's own routing and
experts. The per-layer plan (weights, eps, which MLP) is :meth:`.cpu_decode.CpuDecoder._native_plan`'s. A decode
step of dense layers runs as one C call (``NativeKernels.decode_step``, arguments from :func:`step_args`);
:func:`native_layers` is the same sequence call by call.

Prefill (:func:`prefill`): the chunks of a prefill step, fresh prompts or chunks with cached context before
them (a shared prefix, a chunked long prompt), in one flat batch of ``N`` token rows, taken ``PREFILL_ROWS``
rows at a time through all layers. Per layer, the prologue kernel norms and rotates q and k in the q/k/v GEMM's
output and writes K/V into the paged cache; the attention kernel then gives each (sequence, KV head) one
thread, which packs that sequence's keys and values once from the pages into the decode layout and attends for
each of its rows over positions up to the row's own (causal). Against the torch path (SDPA over a padded,
gathered batch with a boolean mask, ~20 torch ops per layer) it builds no mask, pads nothing and gathers each
sequence's K/V once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from miles_core.rollout.engine_core.attention import AttnBatch
from miles_core.rollout.engine_core.cpu_native import NativeKernels

# rows up to which native_layers runs cpu_native.c's GEMM instead of MKL's (and a decode step is one C call). With the
# weights in panels (2 cores, 2026-12-07) the C GEMMs of a layer took 0.98x / 0.80x / 1.22x of MKL's time at 128 / 256 /
# 512 rows at the quickstart shapes (hidden 128), 0.69x / 0.76x / 0.94x at SmolLM2-135M's; the engine on the latter
# at batch 256 (64-token prompts, 32 new tokens): 197 tok/s with 256 here against 161 with 128 (best of 3)
GEMM_ROWS = 256
# a decode window in one call (window_group): rows per group, and the most weight bytes (every layer's and the lm_head)
# for which it runs: each group reads the weights at every step, so they must stay in cache. Measured at batch 64 with
# the quickstart shapes (1.6 MB of weights; 2 cores, 2026-12-07), groups of 4 / 6 / 8 / 12 / 16 / 32 rows gave
# 51.6k / 55.0k / 55.9k / 48.9k / 54.7k / 50.9k tok/s against 41.9k step by step. Groups of 8 against step by step, at
# batch 64 with larger weights: 6.1 MB (hidden 256) 1.18x, 13.5 MB (hidden 384) 0.91x, 57 MB (hidden 576, 4 layers) 0.64x.
WINDOW_GROUP = 8
WINDOW_WEIGHT_BYTES = 8 << 20
# prefill rows per piece through all layers (cpu_layers.prefill): a piece's activations stay in cache between kernels
PREFILL_ROWS = 512
# rows up to which the lm_head's logits are cpu_native.c's (logits) instead of MKL's: with SmolLM2-135M's head (49152 x
# 576, fp32; 2 cores, 2026-12-07) the C kernel took 0.49x / 0.33x / 0.45x / 0.58x / 0.70x / 0.92x of torch.mm's time at
# 1 / 4 / 8 / 16 / 32 / 64 rows (benchmarks/cpu_step_breakdown.py shows it in the engine)
LOGITS_ROWS = 64
# the most bytes of layer GEMM weights that get a second copy in cpu_native.c's panel layout (NativeKernels.pack; above,
# the GEMMs read W^T and no memory is added). SmolLM2-135M's shapes (427 MB; 2 cores, 2026-12-07): the layer GEMMs at
# 1-6 rows read 1.45-1.8x the bandwidth from panels. 2 GiB holds SmolLM2-360M's and Qwen3-0.6B's layers.
PACK_WEIGHT_BYTES = 2 << 30


class NativeLayer(NamedTuple):
    """One layer as cpu_native.c's kernels take it (:meth:`.cpu_decode.CpuDecoder._native_plan`): the norms'
    weights and eps, the projections as W^T views [in, out] (MKL's operand, and the C GEMM's unless ``panels``),
    the MLP as (module, gate/up W^T or None, activation, down W^T or None), whether that is the reference SwiGLU,
    and (q/k/v, o, gate/up, down) in the C GEMM's panel layout or None (:func:`with_panels`)."""

    ln1: torch.Tensor
    eps1: float
    qkv: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_eps: float
    o: torch.Tensor
    ln2: torch.Tensor
    eps2: float
    mlp: tuple
    swiglu: bool
    panels: tuple | None = None

    def gemm_weights(self) -> tuple:
        """The C GEMM's operands (q/k/v, o, gate/up, down): the panels where there are, else the W^T views."""
        return self.panels or (self.qkv, self.o, self.mlp[1], self.mlp[3])


def with_panels(nat: NativeKernels, nplan: list[NativeLayer]) -> list[NativeLayer]:
    """``nplan`` with every layer's GEMM weights also in the panel layout (:meth:`.cpu_native.NativeKernels.pack`):
    where every layer is a dense SwiGLU one whose weights the C GEMM takes (:func:`gemm_ok`) and the copies stay
    within ``PACK_WEIGHT_BYTES``; else ``nplan`` as it is. The panels are copies: the caller remakes them when a weight
    changes."""
    if not nplan or not all(layer.swiglu for layer in nplan) or not gemm_ok(nplan, 1):
        return nplan
    weights = [w for layer in nplan for w in layer.gemm_weights()]
    if sum(w.numel() * w.element_size() for w in weights) > PACK_WEIGHT_BYTES:
        return nplan
    return [layer._replace(panels=tuple(nat.pack(w, swiglu=i == 2) for i, w in enumerate(layer.gemm_weights())))
            for layer in nplan]


def mlp_residual(x: torch.Tensor, hn: torch.Tensor, mlp, gate_up, act, down_w, run, routed: list) -> torch.Tensor:
    """``x + MLP(hn)``: the fused gate/up GEMM and the layer's activation, or a MoE layer (its routing
    appended to ``routed``), or the module itself."""
    if gate_up is not None:
        gate, up = torch.mm(hn, gate_up).chunk(2, -1)
        return x + torch.mm(act(gate, up), down_w)
    if hasattr(mlp, "route"):  # MoE layer
        ids, w = mlp.route(hn)
        routed.append(ids)
        return x + mlp.combine(hn, ids, w)
    if run.is_moe:  # a dense layer of a MoE model: no routing
        routed.append(torch.full((hn.shape[0], run.moe_k), -1, dtype=torch.long))
    return x + mlp(hn)


# attend(layer, qkv, q_w, k_w, qk_eps) -> [rows, H D]: the layer's attention with its prologue, written into a buffer
Attend = Callable[[int, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", float], torch.Tensor]


def native_layers(nat: NativeKernels, nplan: list[NativeLayer], x: torch.Tensor, attend: Attend, bufs: tuple, run,
                  routed: list, own_gemm: bool) -> torch.Tensor:
    """The layers over the rows of ``x`` [rows, hidden]: per layer RMSNorm, the q/k/v GEMM, ``attend``, the
    o_proj GEMM with the residual added in it, RMSNorm, the gate/up GEMM with SwiGLU, the down GEMM with its
    residual. ``bufs`` (:func:`buffers`): the norm's, SwiGLU's and q/k/v's outputs, each read by the GEMM
    right after it. ``own_gemm`` (:func:`gemm_ok`, a decode step): the GEMMs are cpu_native.c's, SwiGLU in the
    gate/up GEMM's epilogue and the residuals added into ``x`` in place; else (a prefill) MKL's (``torch.mm``,
    ``addmm``). Returns the hidden states before the final norm."""
    h_buf, a_buf, qkv_buf = bufs
    for i, layer in enumerate(nplan):
        qkv_c, o_c, gate_up_c, down_c = layer.gemm_weights()
        hn = nat.rmsnorm(x, layer.ln1, layer.eps1, h_buf)
        qkv = nat.gemm(hn, qkv_c, qkv_buf) if own_gemm else torch.mm(hn, layer.qkv)
        o = attend(i, qkv, layer.q_norm, layer.k_norm, layer.qk_eps)
        x = nat.gemm(o, o_c, x, add=x) if own_gemm else torch.addmm(x, o, layer.o)
        hn = nat.rmsnorm(x, layer.ln2, layer.eps2, h_buf)
        mlp, gate_up, act, down_w = layer.mlp
        if layer.swiglu and own_gemm:
            x = nat.gemm(nat.gemm(hn, gate_up_c, a_buf, swiglu=True), down_c, x, add=x)
        elif layer.swiglu:
            x = torch.addmm(x, nat.silu_mul(torch.mm(hn, gate_up), a_buf), down_w)
        else:
            x = mlp_residual(x, hn, mlp, gate_up, act, down_w, run, routed)
    return x


def window_group(nplan: list[NativeLayer], rows: int, head: torch.Tensor) -> int:
    """Rows per group where a decode window of ``rows`` rows runs in one call
    (:meth:`.cpu_native.NativeKernels.decode_window`: each group through every step on one thread), else 0: every
    layer a dense SwiGLU one whose weights cpu_native.c's GEMM takes, the lm_head weight ``head`` [V, hidden]
    contiguous, and all weights within ``WINDOW_WEIGHT_BYTES``. Groups of ``WINDOW_GROUP`` rows, fewer where there
    would not be one per thread."""
    if not head.is_contiguous() or not all(layer.swiglu for layer in nplan) or not gemm_ok(nplan, 1):
        return 0
    weights = [head, *(w for layer in nplan for w in (layer.ln1, layer.ln2, *layer.gemm_weights()))]
    if sum(w.numel() * w.element_size() for w in weights) > WINDOW_WEIGHT_BYTES:
        return 0
    return max(1, min(WINDOW_GROUP, -(-rows // torch.get_num_threads())))


def logits(nat: NativeKernels | None, xn: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
    """The lm_head's logits [M, V] of the final-normed rows ``xn`` [M, hidden], ``head_w`` = lm_head^T (a view of the
    weight [V, hidden]): the C kernel's up to ``LOGITS_ROWS`` rows where the weight is contiguous, else ``torch.mm``."""
    head = head_w.t()
    if nat is None or xn.shape[0] > LOGITS_ROWS or not head.is_contiguous():
        return torch.mm(xn, head_w)
    return nat.logits(xn.contiguous(), head, torch.empty(xn.shape[0], head.shape[0]))


def gemm_ok(nplan: list[NativeLayer], rows: int) -> bool:
    """Whether :func:`native_layers` runs cpu_native.c's GEMMs for ``rows`` rows: at most ``GEMM_ROWS``, and every
    projection's ``W^T`` contiguous (runner.fuse's CPU layout) with an output width that is a multiple of 16."""
    if rows > GEMM_ROWS:
        return False
    for layer in nplan:
        gate_up, down = layer.mlp[1], layer.mlp[3]
        ws = (layer.qkv, layer.o, gate_up, down) if layer.swiglu else (layer.qkv, layer.o)
        if any(not w.is_contiguous() or w.shape[1] % 16 for w in ws) or (layer.swiglu and gate_up.shape[1] % 32):
            return False
    return True


def step_args(nplan: list[NativeLayer], keys: tuple, values: tuple) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """What :meth:`.cpu_native.NativeKernels.decode_step` takes for a window: per layer the weights' and the window
    buffer's addresses [L, 10] int64, the eps [L, 3] fp32, and whether the GEMM weights are panels; None where a
    layer's MLP is not the reference SwiGLU (MoE: its routing runs in torch). The tensors behind the addresses are
    ``nplan``'s and the window's own."""
    if not all(layer.swiglu for layer in nplan):
        return None
    ptrs, eps = [], []
    for layer, kb, v in zip(nplan, keys, values):
        qkv, o, gate_up, down = layer.gemm_weights()
        ptrs.append([t.data_ptr() if t is not None else 0
                     for t in (layer.ln1, qkv, layer.q_norm, layer.k_norm, o, layer.ln2, gate_up, down, kb, v)])
        eps.append([layer.eps1, layer.eps2, layer.qk_eps])
    return torch.tensor(ptrs, dtype=torch.int64), torch.tensor(eps, dtype=torch.float32), nplan[0].panels is not None


def buffers(nplan: list[NativeLayer], rows: int, hidden: int) -> tuple:
    """The norm's, SwiGLU's and q/k/v's output buffers of :func:`native_layers` for ``rows`` rows."""
    inter = max((layer.mlp[1].shape[1] // 2 for layer in nplan if layer.swiglu), default=0)  # gate_up^T: [hidden, 2I]
    return torch.empty(rows, hidden), torch.empty(rows, inter), torch.empty(rows, nplan[0].qkv.shape[1])


def pieces(q_lens: list[int], ctx: list[int], rows: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """The flat rows of a prefill (chunk ``b``: ``q_lens[b]`` rows ending at position ``ctx[b] - 1``) cut into pieces
    of at most ``rows`` rows, in order, a chunk split where a piece ends: (first row, end row, [(chunk, rows in the
    piece, the context after them)])."""
    out, cur, r0, taken = [], [], 0, 0
    for b, (q, c) in enumerate(zip(q_lens, ctx)):
        done = 0
        while done < q:
            take = min(q - done, rows - taken)
            done, taken = done + take, taken + take
            cur.append((b, take, c - q + done))
            if taken == rows:
                out.append((r0, r0 + taken, cur))
                cur, r0, taken = [], r0 + taken, 0
    if cur:
        out.append((r0, r0 + taken, cur))
    return out


@torch.inference_mode()
def prefill(nat: NativeKernels, nplan: list[NativeLayer], run, rope_tables: tuple, final_norm: tuple, head_w: torch.Tensor,
            input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, meta: AttnBatch,
            logits_index: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:meth:`.runner.ModelRunner.prefill` through the kernels: ``input_ids``, ``positions``, ``slots`` [N]
    int64 (the flat rows of ``meta.num_seqs`` chunks, in order); ``rope_tables`` (cos, sin) [P, 1, D] by
    position (sin unsigned); ``final_norm`` (op, weight, eps); ``head_w`` lm_head^T. Returns (logits [M, V]
    at ``logits_index`` or None, routing [N, L, k] or None).

    The rows go through all layers ``PREFILL_ROWS`` at a time (:func:`pieces`), each piece's K/V in the pages
    before the next piece's attention reads them, so that a piece's activations stay in cache between the
    kernels."""
    model, b = run.model, meta.num_seqs
    n, heads, d = input_ids.shape[0], model.config.num_heads, run.head_dim
    cos_t, sin_t = rope_tables
    q_lens = (meta.q_pos[:b] >= 0).sum(1).tolist()
    tables = meta.block_tables[:b].long()
    ctx = meta.ctx_lens[:b].tolist()
    x = F.embedding(input_ids, model.model.embed_tokens.weight)
    rows = min(n, PREFILL_ROWS)
    bufs, o_full, scale = buffers(nplan, rows, x.shape[1]), torch.empty(rows, heads * d), d**-0.5
    routed: list = []
    for r0, r1, part in pieces(q_lens, ctx, PREFILL_ROWS):
        m = r1 - r0
        seqs = torch.tensor([c for c, _, _ in part])
        q_len, p_ctx = torch.tensor([q for _, q, _ in part]), torch.tensor([e for _, _, e in part])
        p_tables, q_start, o_buf = tables.index_select(0, seqs), q_len.cumsum(0) - q_len, o_full[:m]
        pos, slot = positions[r0:r1], slots[r0:r1]

        def attend(i: int, qkv: torch.Tensor, q_w, k_w, qk_eps: float) -> torch.Tensor:
            kc, vc = run.kv[i, 0], run.kv[i, 1]
            nat.prefill_rope(qkv, pos, cos_t, sin_t, q_w, k_w, qk_eps, kc, vc, slot, heads)
            return nat.prefill_attn(qkv, kc, vc, p_tables, run.block_size, q_start, q_len, p_ctx, o_buf, heads, max(ctx), scale)

        piece: list = []
        x[r0:r1] = native_layers(nat, nplan, x[r0:r1], attend, tuple(t[:m] for t in bufs), run, piece, gemm_ok(nplan, m))
        routed.append(piece)
    routes = torch.cat([torch.stack(p, 1) for p in routed]) if routed[0] else None
    if not logits_index.numel():
        return None, routes
    last = x.index_select(0, logits_index)
    return logits(nat, nat.rmsnorm(last, final_norm[1], final_norm[2], torch.empty_like(last)), head_w), routes
