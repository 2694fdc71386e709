"""The model over the paged KV cache: flat-token forwards for prefill, static-shape decode with
CUDA graphs.

The runner does not own a model implementation: it walks the modules of the shared
:class:`miles_core.models.decoder.Decoder` (or :class:`~miles_core.models.moe.MoeDecoder`) and
calls them on a flat [N, hidden] token batch, writing each layer's K/V into its pages. Every
matmul, norm and rotary call is the decoder's own (up to the fusions below), so engine and trainer
compute the same function.

KV cache layout: one tensor [layers, 2, S, Hk, D] (S = num_blocks * block_size slots).

Fused projections (outside ``exact_attention``): per layer, q/k/v and gate/up run as one GEMM
each. Their weights become row slices (views) of one tensor per layer (:meth:`ModelRunner.fuse`),
so the parameters keep their names and shapes, and an in-place weight update (``copy_``) lands in
the fused tensor too. A fused GEMM rounds like the separate ones up to the GEMM library's choice of
algorithm; ``exact_attention`` keeps the trainer's separate calls.

Fused layer kernels (GPU with Triton, ``fused_kernels``): the q/k norm, rotary and K/V write run as
one kernel after the q/k/v GEMM, and each residual add runs with the norm after it
(:mod:`.triton_fused`): the same math as the decoder's Triton ops in a third of the launches. So
the fast GPU path computes the decoder's function with its own kernels; ``exact_attention`` (the
batch-invariant recipe) keeps the decoder's modules throughout. On sm90+ (``pdl``) those kernels are
chained by programmatic dependent launch, each GEMM prefetching its weights while the kernel before it
runs (:mod:`.triton_pdl`).

Decode state lives in static device buffers (``tokens``, ``positions``, ``ctx_lens``,
``block_tables``) that a CUDA graph, captured once per batch-size bucket, reads and the engine
updates in place between replays; so a decode step needs no host work beyond the replay.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from miles_core.kernels.varlen import causal_varlen
from miles_core.models.decoder import MLP, Attention, RMSNorm
from miles_core.rollout.engine_core import triton_decode, triton_fused, triton_gemm, triton_pdl, triton_sample

from miles_core.rollout.engine_core.attention import AttnBatch, decode_attention_torch, gather_slots, paged_attention
from miles_core.rollout.engine_core.config import EngineConfig

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: EngineConfig, device: torch.device, extra_blocks: int) -> None:
        self.model = model
        self.cfg = cfg
        self.device = device
        mc = model.config
        self.num_layers, self.kv_heads, self.head_dim = mc.num_layers, mc.num_kv_heads, mc.dim_head
        self.dtype = next(model.parameters()).dtype
        self.is_moe = any(hasattr(layer.mlp, "route") for layer in model.model.layers)
        self.moe_k = max((getattr(layer.mlp, "top_k", 0) for layer in model.model.layers), default=0)
        self.block_size = cfg.block_size
        self.max_blocks = -(-cfg.max_model_len // cfg.block_size) + extra_blocks  # table width
        self.kv: torch.Tensor | None = None
        self.num_blocks = 0
        on_gpu = device.type == "cuda"
        exact = cfg.exact_attention
        self.use_graphs = on_gpu and cfg.cuda_graphs and not self.is_moe and not exact  # MoE routing is data dependent
        self.use_triton = on_gpu and cfg.triton_decode and triton_decode.available() and not exact
        self.graph_sizes = sorted(b for b in cfg.graph_batch_sizes if b <= cfg.max_num_seqs) or [cfg.max_num_seqs]
        if self.graph_sizes[-1] < cfg.max_num_seqs:
            self.graph_sizes.append(cfg.max_num_seqs)
        g = self.graph_sizes[-1] if self.use_graphs else cfg.max_num_seqs
        self.tokens = torch.zeros(g, dtype=torch.long, device=device)
        self.positions = torch.zeros(g, dtype=torch.long, device=device)
        self.ctx_lens = torch.zeros(g, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(g, self.max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # a whole step in one graph (decode_sample): per row the sampling temperature and seed, the output
        # counter (the position its draw hashes) and its value at the window's start, the window's outputs
        self.step_temperature = torch.zeros(g, dtype=torch.float32, device=device)
        self.step_seeds = torch.zeros(g, dtype=torch.long, device=device)
        self.step_counters = torch.zeros(g, dtype=torch.long, device=device)
        self.step_counters0 = torch.zeros(g, dtype=torch.long, device=device)
        self.window_tokens = torch.zeros(g, cfg.decode_steps, dtype=torch.long, device=device)
        self.window_logprobs = torch.zeros(g, cfg.decode_steps, dtype=torch.float32, device=device)
        self.step_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._window: DecodeWindow | None = None
        self.last_hidden: torch.Tensor | None = None  # exact_attention: final hidden states of the last logits
        self._side_stream: torch.cuda.Stream | None = None  # the second half-batch's stream (split_at)
        self.split_hidden = torch.zeros(g if cfg.split_decode_rows else 0, model.config.hidden_size, dtype=self.dtype, device=device)
        self.graph_pool = None
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 1
        self.qkv: list[torch.Tensor] = []  # per layer [(H + 2 Hk) D, hidden], see fuse()
        self.gate_up: list[torch.Tensor | None] = []  # per layer [2 I, hidden] (None: MoE layer)
        self.fused_kernels = False
        self.fuse()
        # the fused Triton layer kernels (triton_fused.py) on the fast GPU path; see _layers_fused
        self.fused_kernels = self.use_triton and cfg.fused_kernels and self.fusable()
        self.splitk = self.fused_kernels and cfg.splitk_gemm  # o_proj / down_proj as split-K partials (triton_gemm.py)
        self.gated = self.fused_kernels and cfg.gated_gemm  # gate/up GEMM + SwiGLU in one kernel (triton_gemm.py)
        # programmatic dependent launch for steps of at most PDL_ROWS rows (see pdl_at)
        self.pdl = self.fused_kernels and cfg.pdl and triton_pdl.supported(device)
        # flash varlen attention for prefills of fresh prompts (bf16/fp16 on the fast GPU path), or None
        half = self.dtype in (torch.bfloat16, torch.float16)
        self.varlen = causal_varlen() if self.use_triton and half else None
        # keywords of the paged decode kernel's launch (block_n, num_warps) over triton_decode's defaults;
        # benchmarks set it to compare launches in one process
        self.attn_launch: dict = {}

    PDL_ROWS = 64
    # the q/k/v GEMM's K block under PDL: (block_n 32, block_k 128, 4 stages) took 3.8 µs at 64 rows on the H200,
    # the fastest of 12 launches; block_k 64, 4.0 µs (decode_parts.py --parts launches, 2026-12-05, docs/results/s12)
    QKV_BLOCK_K = 128

    def pdl_at(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows chains its kernels by PDL: only up to 64 rows, where its GEMMs are
        the Triton kernels that prefetch their weights. On the H200 (2026-12-04, docs/results/s10/call3_s10c) PDL
        with the prefetch took batch 64 from 34.8k to 35.3-35.4k tok/s (PDL alone: 34.7k), while at batch 256,
        with cuBLAS GEMMs and multi-wave attention, it cost 5-7% (55.7-57.4k against 60.1k)."""
        return self.pdl and rows <= self.PDL_ROWS

    @property
    def varlen_prefill(self) -> bool:
        """Whether prefills of fresh prompts take the flash varlen path (the core then passes ``cu_seqlens``)."""
        return self.varlen is not None and self.use_triton

    # ------------------------------------------------------------------ fused projections
    def fuse(self) -> None:
        """Make each layer's q/k/v (and dense gate/up) weights views into one tensor; no-op with
        ``exact_attention`` or when a projection is not a plain bias-free ``nn.Linear``.

        On CPU the layer weights are also stored transposed (``W^T`` [in, out] contiguous; each
        parameter a ``.t()`` view of it), so ``F.linear(x, W)`` is the plain row-major GEMM
        ``x @ W^T``: MKL runs it up to 2.5x faster than the transposed-operand GEMM at decode batch
        sizes (2 cores, SmolLM2 and quickstart shapes, 2026-12-06). Values, shapes and in-place
        updates are unchanged; ``lm_head`` keeps its layout (tied to the embedding, and at vocab
        size the transposed one is slower)."""
        self.qkv, self.gate_up = [], []
        self.rope_tables = None
        if self.cfg.exact_attention:
            return
        layers = self.model.model.layers
        plain = lambda *ms: all(type(m) is nn.Linear and m.bias is None for m in ms)  # noqa: E731
        if not all(plain(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj) for l in layers):
            return
        # the Triton kernels (GPU, or a test's interpreter run: call fuse() again after switching) read W [out, in]
        cpu = self.device.type == "cpu" and not (self.use_triton or self.fused_kernels)
        fuse = _fuse_cols if cpu else _fuse_rows
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(fuse(a.q_proj, a.k_proj, a.v_proj))
            dense = hasattr(mlp, "gate_proj") and plain(mlp.gate_proj, mlp.up_proj)
            self.gate_up.append(fuse(mlp.gate_proj, mlp.up_proj) if dense else None)
            for m in (a.o_proj, mlp.down_proj if dense else None):
                if plain(m):  # (no copy when the layout is already so)
                    m.weight.data = m.weight.data.t().contiguous().t() if cpu else m.weight.data.contiguous()
        # cos/sin of every position a block table can address, from the decoder's own _rope (the fused
        # prologue reads rows by position)
        pos = torch.arange(self.max_blocks * self.block_size, device=self.device)
        self.rope_tables = tuple(t[:, 0].contiguous() for t in self.model._rope(pos, self.dtype))

    def fusable(self) -> bool:
        """True if every layer is the decoder's own attention and RMSNorm (whose math the fused
        kernels reproduce) and the q/k/v projections are fused."""
        body = self.model.model
        norms = [body.norm] + [m for layer in body.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        attn = [layer.self_attn for layer in body.layers]
        qk = [m for a in attn if a.cfg.qk_norm for m in (a.q_norm, a.k_norm)]
        return (bool(self.qkv) and triton_fused.supports(self.head_dim) and all(type(a) is Attention for a in attn)
                and all(type(m) is RMSNorm for m in norms + qk))

    def unfuse(self) -> None:
        """Drop the fused tensors (the parameters stay views of them until moved), e.g. before the
        weights are released to host memory; :meth:`fuse` rebuilds them."""
        self.qkv, self.gate_up, self.rope_tables = [], [], None

    # ------------------------------------------------------------------ memory
    def bytes_per_block(self) -> int:
        elem = torch.finfo(self.dtype).bits // 8
        return self.num_layers * 2 * self.block_size * self.kv_heads * self.head_dim * elem

    def allocate_kv(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        shape = (self.num_layers, 2, num_blocks * self.block_size, self.kv_heads, self.head_dim)
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.use_triton and not self._triton_selfcheck():
            log.warning("the Triton paged-decode kernel disagrees with the torch reference here; using torch")
            self.use_triton = False

    def free_kv(self) -> None:
        self.kv = None
        self.graphs.clear()
        self.step_graphs.clear()
        self.graph_pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self.step_graphs.clear()
        self.graph_pool = None

    def _triton_selfcheck(self) -> bool:
        try:
            b, h = 3, self.model.config.num_heads
            q = torch.randn(b, h, self.head_dim, device=self.device, dtype=self.dtype)
            kc = torch.randn_like(self.kv[0, 0][: 8 * self.block_size])
            vc = torch.randn_like(kc)
            bt = torch.randint(0, 8, (b, 4), dtype=torch.int32, device=self.device)
            ctx = torch.tensor([1, 3 * self.block_size + 1, 0], dtype=torch.int32, device=self.device)
            got = triton_decode.paged_decode(q, kc, vc, bt, ctx, self.block_size, splits=2)
            ref = decode_attention_torch(q, kc, vc, bt, ctx, self.block_size, 4 * self.block_size)
            return bool(torch.allclose(got[:2].float(), ref[:2].float(), atol=2e-2, rtol=2e-2)) and bool(got[2].abs().max() == 0)
        except Exception as exc:  # a compile failure on an unusual GPU: the torch path still works
            log.warning("Triton paged-decode kernel failed (%s); using torch", exc)
            return False

    # ------------------------------------------------------------------ forward
    def _layers(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None, attend,
                attend_qkv=None, block_tables: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` [N, hidden]; ``attend(q, k_cache, v_cache) -> [N, H, D]``; ``slots`` None: decode rows, found
        from ``block_tables`` (default: the first N rows of the decode buffer's). ``attend_qkv(qkv, attention
        module, layer) -> [N, H, D]`` (fused path, decode): the prologue and attention in one call, replacing
        both. Returns (hidden, routing [N, L, k])."""
        if slots is None and block_tables is None:
            block_tables = self.block_tables[: x.shape[0]]
        if self.fused_kernels and self.qkv:
            return self._layers_fused(x, positions, slots, attend, attend_qkv, block_tables)
        if slots is None:
            slots = self._decode_slots(block_tables, positions)
        model = self.model
        n = x.shape[0]
        d = self.head_dim
        cos, sin = model._rope(positions, x.dtype)  # [N, 1, D]
        routed = []
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            if self.qkv:
                nq, nk = a.q_proj.out_features, a.k_proj.out_features
                q, k, v = (y.view(n, -1, d) for y in F.linear(h, self.qkv[i]).split([nq, nk, nk], -1))
            else:
                q = a.q_proj(h).view(n, -1, d)
                k = a.k_proj(h).view(n, -1, d)
                v = a.v_proj(h).view(n, -1, d)
            if a.cfg.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            # the op is written for [B, heads, T, D]: each new token is a batch row with T = 1
            cos1, sin1 = cos.unsqueeze(2), sin.unsqueeze(2)
            q, k = a.rope(q.unsqueeze(2), cos1, sin1).squeeze(2), a.rope(k.unsqueeze(2), cos1, sin1).squeeze(2)
            kc, vc = self.kv[i, 0], self.kv[i, 1]
            kc.index_copy_(0, slots, k.to(kc.dtype))
            vc.index_copy_(0, slots, v.to(vc.dtype))
            if self._window is not None and not self.use_graphs:
                self._window.push(i, k, v)
            x = x + a.o_proj(attend(q, kc, vc).reshape(n, -1))
            h = layer.post_attention_layernorm(x)
            mlp = layer.mlp
            if hasattr(mlp, "route"):
                ids, w = mlp.route(h)
                routed.append(ids)
                x = x + mlp.combine(h, ids, w)
            else:
                if self.is_moe:
                    routed.append(torch.full((n, self.moe_k), -1, dtype=torch.long, device=x.device))
                gu = self.gate_up[i] if self.gate_up else None
                if gu is not None:
                    gate, up = F.linear(h, gu).chunk(2, -1)
                    x = x + mlp.down_proj(mlp.act(gate, up))
                else:
                    x = x + mlp(h)
        return model.model.norm(x), (torch.stack(routed, 1) if routed else None)

    def _decode_slots(self, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache slot of each decode row's new token, from its position and block table."""
        p, bs = self.block_size, positions.shape[0]
        page_col = (positions // p).clamp(max=self.max_blocks - 1)
        return block_tables[torch.arange(bs, device=self.device), page_col].long() * p + positions % p

    def _layers_fused(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None, attend,
                      attend_qkv=None, block_tables: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_layers` in fewer kernels (triton_fused.py): per layer the q/k/v GEMM, one prologue
        (q/k norm, rotary from the tables, decode slot, K/V write), attention, o_proj, residual add +
        norm, the MLP (at <= 64 rows with ``gated_gemm``: the gate/up GEMM with the SwiGLU as its epilogue,
        then down_proj), residual add + the next layer's norm."""
        model = self.model
        layers = model.model.layers
        n, d = x.shape[0], self.head_dim
        cos, sin = self.rope_tables
        where = dict(slots=slots) if slots is not None else dict(block_tables=block_tables, page=self.block_size)
        h = layers[0].input_layernorm(x)
        pdl, pf = self.pdl_at(n), self.cfg.pdl_prefetch
        routed = []
        for i, layer in enumerate(layers):
            a = layer.self_attn
            norm = a.cfg.qk_norm
            qkv = triton_gemm.gemm(h, self.qkv[i], block_k=self.QKV_BLOCK_K, pdl=True, prefetch=pf) if pdl else F.linear(h, self.qkv[i])
            if attend_qkv is not None:
                o = attend_qkv(qkv, a, i)
            else:
                q = triton_fused.qkv_prologue(qkv, a.cfg.num_heads, self.kv_heads, d, a.q_norm.weight if norm else None,
                                              a.k_norm.weight if norm else None, a.q_norm.eps if norm else 0.0, positions, cos, sin,
                                              self.kv[i, 0], self.kv[i, 1], **where, pdl=pdl)
                o = attend(q, self.kv[i, 0], self.kv[i, 1])
            post = layer.post_attention_layernorm
            x, h = triton_fused.add_rmsnorm(x, self._out_linear(a.o_proj, o.reshape(n, -1)), post.weight, post.eps, pdl)
            mlp = layer.mlp
            if hasattr(mlp, "route"):
                ids, w = mlp.route(h)
                routed.append(ids)
                out = mlp.combine(h, ids, w)
            else:
                if self.is_moe:
                    routed.append(torch.full((n, self.moe_k), -1, dtype=torch.long, device=x.device))
                gu = self.gate_up[i] if self.gate_up else None
                if gu is not None and self.gated and n <= 64 and isinstance(mlp, MLP):  # mlp.act is the "swiglu" op
                    out = self._out_linear(mlp.down_proj, triton_gemm.gated_gemm(h, gu, pdl=pdl, prefetch=pf))
                elif gu is not None:
                    gate, up = F.linear(h, gu).chunk(2, -1)
                    out = self._out_linear(mlp.down_proj, mlp.act(gate, up))
                else:
                    out = mlp(h)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            x, h = triton_fused.add_rmsnorm(x, out, nxt.weight, nxt.eps, pdl)
        return h, (torch.stack(routed, 1) if routed else None)

    def _out_linear(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A projection back to the hidden size whose output only feeds :func:`.triton_fused.add_rmsnorm`.

        With ``splitk_gemm``, for at most 64 rows, the split-K kernel's fp32 partials (the add sums
        them): on the H200 at 64 rows it took o_proj from cuBLAS's 5.0 to 3.1 µs and down_proj from
        6.6 to 4.0 µs; at 256 rows cuBLAS was the faster (benchmarks/decode_parts.py, 2026-12-03).
        Tiles 32 x 64, half the splits :func:`.triton_gemm.choose_split` gives for one wave (the
        fastest there: fewer partials to write and sum)."""
        if not (self.splitk and x.shape[0] <= 64 and type(linear) is nn.Linear and linear.bias is None):
            return linear(x)
        w = linear.weight
        split = max(1, triton_gemm.choose_split(w.shape[0], w.shape[1], self.num_sms, 32, 64) // 2)
        return triton_gemm.splitk_gemm(x, w, split, block_n=32, block_k=64, pdl=self.pdl_at(x.shape[0]), prefetch=self.cfg.pdl_prefetch)

    @torch.no_grad()
    def prefill(self, input_ids, positions, slots, meta: AttnBatch, logits_index):
        """Flat prefill of chunks of several sequences. Returns (logits [M, V] at ``logits_index``, routing)."""
        x = self.model.model.embed_tokens(input_ids)
        if meta.cu_seqlens is not None and self.varlen_prefill:  # fresh prompts: flash varlen over their own K/V
            rep = self.model.config.num_heads // self.kv_heads

            def attend(q, kc, vc):
                k, v = (c[slots].repeat_interleave(rep, dim=1) if rep > 1 else c[slots] for c in (kc, vc))
                return self.varlen(q, k, v, meta.cu_seqlens, meta.max_q)
        else:
            attend = lambda q, kc, vc: paged_attention(q, kc, vc, meta, self.block_size)  # noqa: E731
        hidden, routed = self._layers(x, positions, slots, attend)
        if self.cfg.exact_attention:
            self.last_hidden = hidden[logits_index]  # the core's logprobs_op reads it
        logits = self.model.lm_head(hidden[logits_index]) if logits_index.numel() else None
        return logits, routed

    def split_at(self, bs: int) -> bool:
        """Whether a decode step of ``bs`` rows runs as two half-batches on two CUDA streams (see
        :meth:`_decode_halves`): with CUDA graphs and the Triton kernels, from ``split_decode_rows`` rows on. ``bs``
        is the graph's bucket (engine.graph_batch_sizes), so a step of 97 rows, padded to 128, splits at 100."""
        n = self.cfg.split_decode_rows
        return bool(n) and bs >= max(n, 2) and self.use_graphs and self.use_triton

    def _decode_body(self, bs: int, max_ctx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.split_at(bs):
            return self._decode_halves(bs, max_ctx), None
        hidden, routed = self._decode_rows(0, bs, max_ctx)
        if self.cfg.exact_attention:
            self.last_hidden = hidden
        return self.model.lm_head(hidden), routed

    def _decode_halves(self, bs: int, max_ctx: int) -> torch.Tensor:
        """The layers of rows [0, h) on the current stream and of rows [h, bs) on a second one, then one
        ``lm_head`` over all rows. The two chains share no tensor but the weights and the K/V cache, whose
        pages they read and write are disjoint (each row has its own table), so the GPU may run one
        half's attention (bound by K/V bandwidth) while the other runs its small GEMMs (bound by
        latency): NanoFlow's nano-batches, here as two branches of the captured graph. The weights each
        half reads are the other's, within a layer's ~30 MB, so the second read mostly hits L2."""
        h = -(-bs // 2)
        main = torch.cuda.current_stream(self.device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        side = self._side_stream
        out = self.split_hidden[:bs]  # a static buffer: no tensor allocated on one stream is freed on the other
        side.wait_stream(main)  # the step's inputs (tokens, positions, tables) as the main stream left them
        out[:h].copy_(self._decode_rows(0, h, max_ctx)[0])
        with torch.cuda.stream(side):
            out[h:].copy_(self._decode_rows(h, bs, max_ctx)[0])
        main.wait_stream(side)
        return self.model.lm_head(out)

    def _decode_rows(self, lo: int, hi: int, max_ctx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over decode rows [lo, hi) of the static buffers -> (final hidden [rows, hidden], routing)."""
        bs = hi - lo
        tokens, positions = self.tokens[lo:hi], self.positions[lo:hi]
        bt, ctx = self.block_tables[lo:hi], self.ctx_lens[lo:hi]
        p = self.block_size
        if self.cfg.exact_attention:  # one query per row through the prefill path (SDPA with a mask)
            rows = torch.arange(bs, device=self.device)
            meta = AttnBatch(bt, ctx.long(), rows, positions[:, None], bs, 1, max_ctx)
            attend = lambda q, kc, vc: paged_attention(q, kc, vc, meta, p)  # noqa: E731
        elif self.use_triton:
            splits = triton_decode.num_splits(bs, self.kv_heads, self.num_sms)
            launch = self.attn_launch
            attend = lambda q, kc, vc: triton_decode.paged_decode(q, kc, vc, bt, ctx, p, splits, pdl=self.pdl_at(bs), **launch)  # noqa: E731
        elif self._window is not None:
            attend = self._window.attend
        else:
            attend = lambda q, kc, vc: decode_attention_torch(q, kc, vc, bt, ctx, p, max_ctx)  # noqa: E731
        attend_qkv = None
        # the prologue inside attention at <= 64 rows only: alone on the H200 (2026-12-05, decode_parts --parts prologue)
        # it saved 0.3-0.4 µs per layer at batch 1 and 64 and cost 3.2 µs at 256
        if self.use_triton and self.fused_kernels and self.cfg.fused_attention and not self.cfg.exact_attention and bs <= 64:
            cos, sin = self.rope_tables

            def attend_qkv(qkv, a, i):
                norm = a.cfg.qk_norm
                return triton_decode.paged_decode_qkv(
                    qkv, a.cfg.num_heads, a.q_norm.weight if norm else None, a.k_norm.weight if norm else None,
                    a.q_norm.eps if norm else 0.0, positions, cos, sin, self.kv[i, 0], self.kv[i, 1], bt, ctx, p, splits,
                    pdl=self.pdl_at(bs), **launch)
        x = self.model.model.embed_tokens(tokens)
        return self._layers(x, positions, None, attend, attend_qkv, bt)

    def begin_window(self, bs: int, steps: int) -> None:
        """Eager decode only: gather every row's cached K/V once for a window of ``steps`` steps."""
        if self.use_graphs or self.use_triton or self.fused_kernels or self.cfg.exact_attention:
            return
        self._window = DecodeWindow.open(self.kv, self.block_tables[:bs], self.positions[:bs], self.block_size, steps)

    def end_window(self) -> None:
        self._window = None

    def _bucket(self, bs: int) -> int:
        return next(b for b in self.graph_sizes if b >= bs)

    @torch.no_grad()
    def decode(self, bs: int, max_ctx: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step over the first ``bs`` rows of the static buffers -> (logits [bs, V], routing).

        ``max_ctx`` (a multiple of the block size) bounds the context for the torch path; with
        graphs the bucket's captured graph is replayed (rows past ``bs`` are padding: ctx 0, page 0).
        """
        if not self.use_graphs:
            if self._window is not None:
                self._window.step = step
            return self._decode_body(bs, max_ctx)
        b = self._bucket(bs)
        if b not in self.graphs:
            self._capture(b)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:bs], None

    # ------------------------------------------------------------------ a whole step in one graph
    def samples_in_graph(self, st) -> bool:
        """Whether a window with these sampling tensors (:class:`.sampler.SamplingTensors`) can run as
        :meth:`decode_sample` replays: graphs and the Triton sampler on, no top-k/top-p/min-p filter (its
        threshold is found in torch) and no top logprobs."""
        return (self.use_graphs and self.cfg.graph_sampling and triton_sample.available() and st.max_top_logprobs == 0
                and not st.any_top_p_or_k and not st.any_min_p)

    def begin_sampled_window(self, bs: int, st, counters: torch.Tensor) -> None:
        """Load the first ``bs`` rows' sampling state before a window of :meth:`decode_sample` steps (the
        bucket's padding rows: greedy, counter 0). ``counters`` [bs]: each row's output position."""
        end = self._bucket(bs)
        for buf, val in ((self.step_temperature, st.temperature), (self.step_seeds, st.seeds), (self.step_counters, counters),
                         (self.step_counters0, counters)):
            buf[:bs] = val
            buf[bs:end] = 0

    def decode_sample(self, bs: int, sampled: bool) -> None:
        """One decode step of the first ``bs`` rows, sampling included, as one graph replay: the token and
        logprob of step ``j`` of the window land in column ``j`` of ``window_tokens`` / ``window_logprobs``,
        and ``tokens``, ``positions``, ``ctx_lens`` move on for the next step (:class:`.triton_sample.Advance`).
        ``sampled``: some row has a temperature > 0 (else the sampler skips the noise)."""
        key = (self._bucket(bs), sampled)
        if key not in self.step_graphs:
            self._capture_step(*key)
        self.step_graphs[key].replay()

    def _sample_step(self, bs: int, sampled: bool, advance: triton_sample.Advance, counters: torch.Tensor) -> None:
        logits, _ = self._decode_body(bs, self.max_blocks * self.block_size)
        triton_sample.sample_rows(logits, self.step_temperature[:bs], None, self.step_seeds[:bs], counters, sampled, advance=advance)

    def _capture_step(self, bs: int, sampled: bool) -> None:
        rows = slice(0, bs)
        real = triton_sample.Advance(self.tokens[rows], self.positions[rows], self.ctx_lens[rows], self.step_counters0[rows],
                                     self.window_tokens[rows], self.window_logprobs[rows])
        # the warm-up runs (they compile the kernels) move copies of the state on, not the state itself
        scratch = triton_sample.Advance(*(t.clone() for t in (real.tokens, real.positions, real.ctx_lens, real.counters0,
                                                                real.out_tokens, real.out_logprobs)))
        counters = self.step_counters[rows]
        graph, _ = self._captured(lambda warm: self._sample_step(bs, sampled, scratch if warm else real,
                                                                counters.clone() if warm else counters))
        self.step_graphs[(bs, sampled)] = graph

    def _capture(self, bs: int) -> None:
        full = self.max_blocks * self.block_size
        self.graphs[bs] = self._captured(lambda warm: self._decode_body(bs, full)[0])

    def _captured(self, body) -> tuple[torch.cuda.CUDAGraph, object]:
        """Run ``body(True)`` twice on a side stream (it compiles the kernels), then capture ``body(False)`` in a
        graph of the shared pool. Returns (the graph, what the captured call returned: its static output)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                body(True)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            out = body(False)
        return graph, out

def _fuse_rows(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the weights [out_i, in] into one [sum out_i, in] tensor and rebind each weight as
    its row slice (a contiguous view)."""
    fused = torch.cat([m.weight.data for m in linears])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = fused[start:start + rows]
        start += rows
    return fused


def _fuse_cols(*linears: nn.Linear) -> torch.Tensor:
    """:func:`_fuse_rows` with the storage transposed: ``W^T`` [in, sum out_i] contiguous, each
    weight rebound as the ``.t()`` of its column slice. Returns the fused ``[sum out_i, in]`` view."""
    fused_t = torch.cat([m.weight.data.t() for m in linears], 1)
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = fused_t[:, start:start + rows].t()
        start += rows
    return fused_t.t()


@dataclass
class DecodeWindow:
    """The eager decode path's K/V for one window: the context gathered once at its start, plus the
    tokens decoded since. Attention at step ``j`` is one softmax over both parts::

        out = softmax(scale * [q K_old^T, q K_new[:j+1]^T]) [V_old; V_new[:j+1]]

    which equals attention over the paged cache without re-gathering it every step (with a sliding
    window ``w``, the query at position ``pos0 + j`` sees the positions after ``pos0 + j - w``).
    """

    pos0: torch.Tensor  # [B] cache positions < pos0 are in keys/values
    keys: list[torch.Tensor]  # per layer [B, Hk, T0, D]
    values: list[torch.Tensor]
    new_k: torch.Tensor  # [L, B, Hk, steps, D]
    new_v: torch.Tensor
    step: int = 0
    layer: int = 0

    @classmethod
    def open(cls, kv: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, steps: int) -> DecodeWindow:
        """``kv`` [L, 2, S, Hk, D]; the rows' ``block_tables`` [B, W] and next ``positions`` [B]."""
        nl, _, _, hk, d = kv.shape
        bs = positions.shape[0]
        pos0 = positions.clone()  # cache positions < pos0 exist before the window
        t0 = max(block_size, -(-int(pos0.max()) // block_size) * block_size)
        slots = gather_slots(block_tables, t0, block_size).flatten()
        g = lambda c: c.index_select(0, slots).view(bs, t0, hk, d).transpose(1, 2).contiguous()  # noqa: E731
        new = lambda: torch.zeros(nl, bs, hk, steps, d, dtype=kv.dtype, device=kv.device)  # noqa: E731
        return cls(pos0=pos0, keys=[g(kv[i, 0]) for i in range(nl)], values=[g(kv[i, 1]) for i in range(nl)], new_k=new(), new_v=new())

    def push(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layer = layer
        self.new_k[layer, :, :, self.step] = k
        self.new_v[layer, :, :, self.step] = v

    def attend(self, q: torch.Tensor, _kc=None, _vc=None, scale: float | None = None, window: int | None = None) -> torch.Tensor:
        b, h, d = q.shape
        i, j = self.layer, self.step
        kold, vold = self.keys[i], self.values[i]
        hk = kold.shape[1]
        qg = q.view(b, hk, h // hk, d)
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        s_old = torch.matmul(qg, kold.transpose(-1, -2)).float() * scale  # [B, Hk, R, T0]
        kpos = torch.arange(kold.shape[2], device=q.device)[None, :]
        valid = kpos < self.pos0[:, None]
        if window is not None:
            valid = valid & (kpos > self.pos0[:, None] + j - window)
        s_old = s_old.masked_fill(~valid[:, None, None, :], float("-inf"))
        knew, vnew = self.new_k[i, :, :, : j + 1], self.new_v[i, :, :, : j + 1]
        s_new = torch.matmul(qg, knew.transpose(-1, -2)).float() * scale  # [B, Hk, R, j+1]
        if window is not None and j + 1 > window:
            s_new[..., : j + 1 - window] = float("-inf")
        probs = torch.softmax(torch.cat([s_old, s_new], -1), -1).to(q.dtype)
        t0 = kold.shape[2]
        out = torch.matmul(probs[..., :t0], vold) + torch.matmul(probs[..., t0:], vnew)
        return out.reshape(b, h, d)
