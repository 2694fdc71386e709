"""The engine core: ``add_request`` / ``step`` / ``abort`` / ``has_unfinished``.

Each :meth:`EngineCore.step` asks the scheduler for a plan and runs it:

* a prefill step packs prompt chunks of several requests into one flat token batch; a request
  whose prompt is complete samples its first token from the last position's logits;
* a decode window runs ``decode_steps`` steps for every running request with no host sync in
  between: the sampled tokens go straight back into the runner's static buffers (positions and
  context lengths advance on the device), and one copy to the host at the end hands the tokens
  and logprobs to the requests. Stop tokens, stop strings and length limits are checked then; a
  request that finished inside the window drops the tokens after its end (their K/V went to its
  own pages or to the padding page, and are never read). On CPU the window runs through
  :mod:`.cpu_decode` (``EngineConfig.cpu_decode_window``): contiguous K/V kept across windows,
  a fraction of the per-step host work.
* overlapped windows (``EngineConfig.overlap_windows``, device paths): while the same requests keep
  decoding, the next window is launched before the last one's tokens are read, so the device runs
  window ``w + 1`` while the host hands out window ``w``'s tokens and checks their stop conditions
  (SGLang's overlap scheduler does the same for its batches). The tokens travel to pinned host
  memory behind an event; the host waits for that window alone. A request that stops inside window
  ``w`` has decoded one window too many: those tokens are dropped like the rest of a window after a
  stop, and their K/V went to the request's own pages, freed (in stream order) after it ends.

The core is single-threaded; :mod:`miles_core.rollout.engine_core.threaded` drives it from a
background thread for the HTTP server.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from miles_core.errors import DataError, MilesUserError
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core import cpu_decode
from miles_core.rollout.engine_core.attention import AttnBatch
from miles_core.rollout.engine_core.blocks import BlockManager
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.host import to_device, to_host
from miles_core.rollout.engine_core.request import Request, RequestOutput, Status
from miles_core.rollout.engine_core.runner import ModelRunner
from miles_core.rollout.engine_core.sampler import SamplingTensors, sample
from miles_core.rollout.engine_core.scheduler import DecodePlan, PrefillPlan, Scheduler, final_len
from miles_core.rollout.engine_core.transformers_runner import TransformersRunner, is_transformers_model


class EngineCore:
    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None = None,
        eos_token_ids: Iterable[int] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        seed: int = 0,
        logprobs_op: Callable | None = None,
        logprobs_dtype: torch.dtype | None = None,
        special_token_id: Callable[[str], int | None] | None = None,
    ) -> None:
        """``model`` is a Decoder already on its device, in its serving dtype; the core uses it as is. A
        transformers model loaded by :func:`.transformers_runner.load_transformers_model` (an architecture
        with no Miles family) runs through :class:`.transformers_runner.TransformersRunner` instead.

        ``logprobs_op`` (the trainer's kernel op "logprobs", with ``config.exact_attention``): the
        reported logprob of each sampled token is recomputed by that op from the final hidden state
        (cast to ``logprobs_dtype``), exactly as the trainer computes it, instead of by the sampler.

        ``special_token_id(text)``: the id of the special token spelled ``text``, else None
        (:meth:`~miles_core.data.tokenizer.HFTokenizer.special_token_id`). ``detokenize`` skips special tokens, so a
        stop string that is one (``"<|im_end|>"``) never appeared in the text: such a stop is matched as its token."""
        self.cfg = config or EngineConfig()
        self.cfg.validate()
        self.model = model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.device = next(model.parameters()).device
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids if t is not None)
        self.detokenize = detokenize
        self.special_token_id = special_token_id
        self.rng = random.Random(seed)
        self.logprobs_op, self.logprobs_dtype = logprobs_op, logprobs_dtype
        self.weight_version = 0
        self.max_model_len = min(self.cfg.max_model_len, getattr(model.config, "max_position_embeddings", None) or self.cfg.max_model_len)
        bs = self.cfg.block_size
        runner = TransformersRunner if is_transformers_model(model) else ModelRunner
        self.runner = runner(model, self.cfg, self.device, extra_blocks=-(-self.cfg.decode_steps // bs) + 1)
        self._cpu = cpu_decode.CpuDecoder(self.runner, self.max_model_len, self.cfg.cpu_kernels)  # used when cfg.cpu_decode_window and on CPU
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # aborts, reported by the next step
        self._st_cache: tuple[list[Request], SamplingTensors | None] = ([], None)  # see _sampling_tensors
        self.released: set[str] = set()
        self._inflight: _Window | None = None  # a launched decode window whose tokens are not handed out yet
        self.windows_ahead = 0  # decode windows launched before the previous one was read (overlap_windows)
        self._allocate_kv()

    # ------------------------------------------------------------------ memory
    def _num_blocks(self) -> int:
        cfg, bs = self.cfg, self.cfg.block_size
        floor = -(-self.max_model_len // bs) + 2
        if cfg.num_blocks is not None:
            return max(cfg.num_blocks, floor)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(floor, int(free * cfg.kv_memory_fraction) // self.runner.bytes_per_block())
        return max(floor, -(-cfg.kv_tokens_cpu // bs) + 1)

    def _allocate_kv(self) -> None:
        n = self._num_blocks()
        self.runner.allocate_kv(n)
        self._cpu.reset()
        self.blocks = BlockManager(n, self.cfg.block_size, self.cfg.prefix_caching)
        self.scheduler = Scheduler(self.cfg, self.blocks, lambda r: not self.runner.is_moe or r.leader is not None, self.max_model_len)
        s = self.cfg.max_num_seqs
        self._table = torch.zeros(s, self.runner.max_blocks, dtype=torch.int32, device=self.device)
        self._table_owner: list[Request | None] = [None] * s
        self._table_len = [0] * s

    def release_memory(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        """Free device memory for a colocated trainer: the KV cache (contents dropped) and/or the
        weights (moved to host memory). Only while no request is in flight."""
        tags = set(tags)
        if bad := tags - {"weights", "kv_cache"}:
            raise MilesUserError(f"release_memory: unknown tags {sorted(bad)} (use weights, kv_cache)")
        self._drain()
        if self.has_unfinished():
            raise MilesUserError("release_memory: requests are in flight; abort or finish them first")
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.runner.free_kv()
            self._cpu.reset()
            self.released.add("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            self.runner.drop_graphs()
            self.runner.unfuse()
            self._cpu.drop_statics()  # on CPU: the weights' panel copies
            for t in itertools.chain(self.model.parameters(), self.model.buffers()):
                t.data = t.data.to("cpu")
            self.released.add("weights")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def resume_memory(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        tags = set(tags)
        if "weights" in tags and "weights" in self.released:
            for t in itertools.chain(self.model.parameters(), self.model.buffers()):
                t.data = t.data.to(self.device)
            self.runner.fuse()
            self.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.released:
            self._allocate_kv()
            self.released.discard("kv_cache")

    def _check_resident(self) -> None:
        if self.released:
            raise MilesUserError(f"the engine's {', '.join(sorted(self.released))} are released; resume_memory first")

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Copy tensors (names as in the model's state dict) into the weights, in place."""
        self._drain()  # a window in flight finishes with the weights it started with
        own = self.model.state_dict()
        unknown = [n for n in state_dict if n not in own]
        if unknown:
            raise MilesUserError(f"update_weights: unknown parameter names {unknown[:3]}")
        for name, tensor in state_dict.items():  # every shape is checked before any weight is touched
            if own[name].shape != tensor.shape:
                raise MilesUserError(f"update_weights: '{name}' has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
        for name, tensor in state_dict.items():
            own[name].copy_(tensor)
        self.weight_version = self.weight_version + 1 if version is None else version
        self.blocks.flush()  # cached prefixes were computed with the old weights

    def update_weights_from_disk(self, path: str | Path, version: int | None = None) -> None:
        """Load an HF folder's weights (``read_safetensors``: its model.safetensors, else the shards its index names) in place."""
        from miles_core.models.checkpoint import read_safetensors

        state = read_safetensors(Path(path))
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        self.update_weights(state, version)

    def flush_cache(self) -> bool:
        """Forget cached prefixes; SGLang refuses while requests run, and so do we (returns False)."""
        if self.has_unfinished():
            return False
        self.blocks.flush()
        return True

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, n: int = 1) -> list[Request]:
        """Queue ``n`` samples of one prompt (ids ``ID`` for n=1, else ``ID-0 .. ID-{n-1}``); they share its KV."""
        self._check_resident()
        if not prompt_ids:
            raise DataError("the prompt is empty (input_ids or text must give at least one token)")
        if len(prompt_ids) >= self.max_model_len:
            raise DataError(f"the prompt has {len(prompt_ids)} tokens; the engine's max_model_len is {self.max_model_len}")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise DataError(f"input_ids must be in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
        if params.max_new_tokens < 1:
            raise DataError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if isinstance(params.stop, str):  # would be taken character by character
            raise DataError(f"stop must be a list of strings, got the string {params.stop!r} (use [{params.stop!r}])")
        if (empty := next((i for i, s in enumerate(params.stop) if not s), None)) is not None:  # '' is in every text
            raise DataError(f"stop strings must be non-empty (stop[{empty}] is {params.stop[empty]!r})")
        if not 0 <= params.min_p <= 1:  # past 1 the cut is above the top probability: every token dropped, token 0 drawn
            raise DataError(f"min_p must be in [0, 1], got {params.min_p}")
        if not 0 <= params.top_logprobs <= vocab:  # more would fail the whole step's top-k, every request in it
            raise DataError(f"top_logprobs must be in [0, {vocab}], got {params.top_logprobs}")
        if params.seed is not None and not -(1 << 63) <= params.seed <= (1 << 63) - n:  # the n samples' seeds are int64
            raise DataError(f"seed must be a 64-bit integer (with n={n}: at most 2**63 - {n}), got {params.seed}")
        if params.stop and self.special_token_id is not None:  # special tokens' texts: stop on their ids
            ids = {s: self.special_token_id(s) for s in params.stop}
            if any(i is not None for i in ids.values()):
                params = replace(params, stop=[s for s, i in ids.items() if i is None],
                                 stop_token_ids=[*params.stop_token_ids, *(i for i in ids.values() if i is not None)])
        base = request_id if request_id is not None else f"req-{next(self._ids)}"
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        rids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
        if (taken := next((rid for rid in rids if rid in self.requests), None)) is not None:  # before any sample is queued
            raise DataError(f"request id '{taken}' is already in use")
        out: list[Request] = []
        for i, rid in enumerate(rids):
            seed = params.seed + i if params.seed is not None else self.rng.getrandbits(62)
            req = Request(rid, list(prompt_ids), params, seed, stop_ids, leader=out[0] if out else None,
                          group_id=base if n > 1 else None)
            self.requests[rid] = req
            self.scheduler.waiting.append(req)
            out.append(req)
        return out

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        self._pending.append(RequestOutput(req.request_id, [], [], True, req))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def _drain(self) -> None:
        """Hand out the window in flight, if any (its outputs go to the next step's report)."""
        if self._inflight is not None:
            w, self._inflight = self._inflight, None
            self._pending += self._collect(w)

    def _finish(self, req: Request, reason: str, matched=None) -> None:
        req.finish_reason, req.matched_stop = reason, matched
        req.weight_version = self.weight_version
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._inflight is not None:
            w, self._inflight = self._inflight, None
            return outputs + self._hand_out(w)
        if not self.scheduler.has_work():
            return outputs
        self._check_resident()
        plan = self.scheduler.schedule()
        if isinstance(plan, PrefillPlan):
            outputs += self._prefill(plan)
        elif isinstance(plan, DecodePlan):
            outputs += self._decode(plan)
        return outputs

    def _prefill(self, plan: PrefillPlan) -> list[RequestOutput]:
        p, dev = self.cfg.block_size, self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens, ctx = [], []
        sample_rows, sample_reqs = [], []
        for req, n in plan.chunks:
            start = req.num_computed
            ids += req.all_ids[start : start + n]
            rng = range(start, start + n)
            pos += rng
            slots += [req.block_ids[t // p] * p + t % p for t in rng]
            q_lens.append(n)
            ctx.append(start + n)
            if start + n == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(req)
        b, qmax = len(q_lens), max(q_lens)
        width = max(len(r.block_ids) for r, _ in plan.chunks)
        tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r, _ in plan.chunks]
        q_index = [row * qmax + i for row, n in enumerate(q_lens) for i in range(n)]
        q_pos = [[c - n + i if i < n else -1 for i in range(qmax)] for n, c in zip(q_lens, ctx)]
        meta = AttnBatch(
            block_tables=to_device(tables, torch.long, dev),
            ctx_lens=to_device(ctx, torch.long, dev),
            q_index=to_device(q_index, torch.long, dev),
            q_pos=to_device(q_pos, torch.long, dev),
            num_seqs=b,
            max_q=qmax,
            max_ctx=-(-max(ctx) // p) * p,
        )
        if self.runner.varlen_prefill and all(c == n for c, n in zip(ctx, q_lens)):  # no chunk has context before it
            meta.cu_seqlens = to_device([0, *itertools.accumulate(q_lens)], torch.int32, dev)
        as_long = lambda xs: to_device(xs, torch.long, dev)  # noqa: E731
        args = (as_long(ids), as_long(pos), as_long(slots), meta, as_long(sample_rows))
        native = self._cpu.prefill(*args) if self.device.type == "cpu" else None  # the fused CPU kernels, where they run
        logits, routed = native if native is not None else self.runner.prefill(*args)
        offset = 0
        for req, n in plan.chunks:
            if routed is not None:
                if req.num_computed == req.num_cached:  # its first chunk since admission: the routing starts over
                    # (a preempted request recomputes from its first token); a group's cached prompt is the leader's
                    lead = req.leader if req.num_cached else None
                    req.routed_experts = [torch.cat(lead.routed_experts)[: req.num_cached]] if lead is not None else []
                req.routed_experts.append(routed[offset : offset + n].cpu())
            offset += n
            req.num_computed += n
            self.blocks.commit(req)
        if not sample_reqs:
            return []
        # the waiting samples of groups whose leader has just computed its prompt start from its pages and logits
        leaders = [r for r in sample_reqs if r.leader is None and not r.output_ids]
        forked = self.scheduler.fork_followers(leaders) if leaders else []
        rows = None  # the logits row each sampled request draws from: its own unless forked
        if forked:
            self._copy_prompt_tails(forked)
            row_of = {id(r): i for i, r in enumerate(sample_reqs)}
            rows = list(range(len(sample_reqs))) + [row_of[id(f.leader)] for f in forked]
            if routed is not None:  # the prompt's routing: the leader's (it has decoded nothing yet)
                for f in forked:
                    f.routed_experts = [torch.cat(f.leader.routed_experts)]
            sample_reqs = sample_reqs + forked
            logits = logits[to_device(rows, torch.long, dev)]
        st = SamplingTensors.build([r.params for r in sample_reqs], [r.seed for r in sample_reqs], dev)
        counters = to_device([len(r.output_ids) for r in sample_reqs], torch.long, dev)
        tok, lp, top = sample(logits, st, counters)
        lp = self._op_logprobs(tok, lp, st, rows)
        toks, lps = tok.tolist(), lp.tolist()
        tops = _top_lists(top, [r.params.top_logprobs for r in sample_reqs])
        return [self._append(r, [toks[i]], [lps[i]], [tops[i]] if tops else None) for i, r in enumerate(sample_reqs)]

    def _copy_prompt_tails(self, forked: list[Request]) -> None:
        """Copy each forked sample's partial last prompt page from its leader's (the full pages are shared)."""
        p, src, dst = self.cfg.block_size, [], []
        for f in forked:
            n = len(f.prompt_ids)
            if n % p:
                s0, d0 = f.leader.block_ids[n // p] * p, f.block_ids[n // p] * p
                src += range(s0, s0 + n % p)
                dst += range(d0, d0 + n % p)
        if dst:
            kv = self.runner.kv  # [L, 2, slots, Hk, D]
            kv.index_copy_(2, to_device(dst, torch.long, self.device), kv.index_select(2, to_device(src, torch.long, self.device)))

    def _op_logprobs(self, tok: torch.Tensor, lp: torch.Tensor, st: SamplingTensors, rows: list[int] | None = None) -> torch.Tensor:
        """The trainer's logprob of each sampled token (rows grouped by temperature; 0 = greedy -> 1);
        ``rows``: the rows of the last hidden states they were drawn from (default: one each, in order)."""
        if self.logprobs_op is None:
            return lp
        h = self.runner.last_hidden
        if rows is not None:
            h = h[to_device(rows, torch.long, h.device)]
        if self.logprobs_dtype is not None:
            h = h.to(self.logprobs_dtype)
        w = self.model.lm_head.weight
        out = torch.empty_like(lp)
        temps = st.temperature.tolist()
        for t in sorted(set(temps)):
            rows = to_device([i for i, x in enumerate(temps) if x == t], torch.long, tok.device)
            out[rows] = self.logprobs_op(h[rows], w, tok[rows], temperature=t if t > 0 else 1.0)[0].float()
        return out

    def _decode(self, plan: DecodePlan) -> list[RequestOutput]:
        reqs, k = plan.requests, plan.steps
        if not reqs:
            return []
        run = self.runner
        last = to_device([[r.output_ids[-1], r.num_tokens - 1, len(r.output_ids)] for r in reqs], torch.long, self.device)
        st, counters = self._sampling_tensors(reqs), last[:, 2]
        if self.cfg.cpu_decode_window and cpu_decode.supported(run):
            w = self._cpu.window(reqs, last[:, 0], last[:, 1], self._tables(reqs), k, self._cpu.sampler(st, counters))
            outputs = self._window_outputs(reqs, w.tokens, w.logprobs, w.tops, w.routes)
            if not self.scheduler.running:  # nothing left to decode: free the kept K/V buffer
                self._cpu.reset()
            return outputs
        b = len(reqs)
        run.tokens[:b] = last[:, 0]
        run.positions[:b] = last[:, 1]
        run.ctx_lens[:b] = (last[:, 1] + 1).to(torch.int32)
        if run.use_graphs:  # padding rows of the bucket: context 0, page 0
            end = run._bucket(b)
            run.tokens[b:end] = 0
            run.positions[b:end] = 0
            run.ctx_lens[b:end] = 0
            run.block_tables[b:end] = 0
        return self._hand_out(self._launch(reqs, k, counters, ahead=0))

    def _tables(self, reqs: list[Request]) -> torch.Tensor:
        """The rows' page tables [B, max_blocks], brought up to date (only new pages travel)."""
        dev = self.device
        rows, cols, vals, zero = [], [], [], []
        for r in reqs:
            s = r.slot
            if self._table_owner[s] is not r:
                self._table_owner[s], self._table_len[s] = r, 0
                zero.append(s)
            have = self._table_len[s]
            if len(r.block_ids) > have:
                rows += [s] * (len(r.block_ids) - have)
                cols += range(have, len(r.block_ids))
                vals += r.block_ids[have:]
                self._table_len[s] = len(r.block_ids)
        if zero:
            self._table.index_fill_(0, to_device(zero, torch.long, dev), 0)  # (an indexed assignment of 0 syncs)
        if rows:
            self._table[to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)] = to_device(vals, torch.int32, dev)
        return self._table[to_device([r.slot for r in reqs], torch.long, dev)]

    def _launch(self, reqs: list[Request], k: int, counters: torch.Tensor, ahead: int) -> _Window:
        """Enqueue ``k`` decode steps of ``reqs`` from the runner's buffers (tokens, positions and
        context lengths already set); ``ahead``: tokens the rows have decoded past their host state
        (a window launched before the last one was handed out). Nothing here waits for the device."""
        run, b, p = self.runner, len(reqs), self.cfg.block_size
        run.block_tables[:b] = self._tables(reqs)
        st = self._sampling_tensors(reqs)
        max_ctx = min(-(-(max(r.num_tokens for r in reqs) + ahead + k) // p) * p, run.max_blocks * p)
        tops, routes = [], []
        if self.logprobs_op is None and run.samples_in_graph(st):  # each step one graph replay, sampling included
            run.begin_sampled_window(b, st, counters)
            for _ in range(k):
                run.decode_sample(b, st.any_sampled)
            return self._window(reqs, k, counters, run.window_tokens[:b, :k], run.window_logprobs[:b, :k], tops, routes)
        out_tok = torch.empty(b, k, dtype=torch.long, device=self.device)
        out_lp = torch.empty(b, k, dtype=torch.float32, device=self.device)
        run.begin_window(b, k)
        for j in range(k):
            logits, routed = run.decode(b, max_ctx, j)
            tok, lp, top = sample(logits, st, counters + j)
            lp = self._op_logprobs(tok, lp, st)
            out_tok[:, j] = tok
            out_lp[:, j] = lp
            if top is not None:
                tops.append(top)
            if routed is not None:
                routes.append(routed)
            run.tokens[:b] = tok
            run.positions[:b] += 1
            run.ctx_lens[:b] += 1
        run.end_window()
        return self._window(reqs, k, counters, out_tok, out_lp, tops, routes)

    def _window(self, reqs: list[Request], k: int, counters: torch.Tensor, out_tok, out_lp, tops: list, routes: list) -> _Window:
        """A launched window: its outputs' copies to the host enqueued behind its steps, and an event after them."""
        host = to_host([out_tok, out_lp, *(t for top in tops for t in (top.values, top.indices)), *routes])
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        n = len(tops)
        tops_h = [_Top(host[2 + 2 * i], host[3 + 2 * i]) for i in range(n)]
        return _Window(reqs, k, counters, host[0], host[1], tops_h, host[2 + 2 * n:], done)

    def _hand_out(self, w: _Window) -> list[RequestOutput]:
        """Launch the window after ``w`` if it may run ahead, then hand ``w``'s tokens to its requests."""
        nxt = self._launch_ahead(w)
        outputs = self._collect(w)
        self._inflight = nxt
        return outputs

    def _launch_ahead(self, w: _Window) -> _Window | None:
        """The next window of ``w``'s requests, launched before ``w`` is read, when the batch would be
        the same one anyway: overlap on, no host round trip per step (the trainer's logprobs op),
        nothing waiting to be admitted, every row still running and not ending by length inside ``w``,
        and pages for the new window free without preempting anyone. (``w`` came from the device path:
        the CPU decode window never runs ahead.)"""
        sch, reqs, k = self.scheduler, w.reqs, self.cfg.decode_steps
        if not self.cfg.overlap_windows or self.logprobs_op is not None or sch.waiting or self._pending:
            return None
        if len(sch.running) != len(reqs) or any(r.finished for r in reqs):
            return None
        done = w.steps  # every window before w has been handed out: w adds this many tokens to each row
        limits = [final_len(r, self.max_model_len) for r in reqs]
        if any(r.num_tokens + done >= lim for r, lim in zip(reqs, limits)):
            return None
        if not all(self.blocks.grow(r, min(r.num_tokens + done - 1 + k, lim - 1)) for r, lim in zip(reqs, limits)):
            return None
        self.windows_ahead += 1
        return self._launch(reqs, k, w.counters + w.steps, ahead=done)

    def _collect(self, w: _Window) -> list[RequestOutput]:
        """Wait for ``w``'s tokens and give them to its requests still running (stop checks there)."""
        if w.done is not None:
            w.done.synchronize()
        live = [i for i, r in enumerate(w.reqs) if not r.finished]  # a row may have ended (stop, abort) meanwhile
        if len(live) < len(w.reqs):
            rows = torch.tensor(live, dtype=torch.long)
            pick = lambda t: t.index_select(0, rows)  # noqa: E731
            return self._window_outputs([w.reqs[i] for i in live], pick(w.tokens), pick(w.logprobs),
                                        [_Top(pick(t.values), pick(t.indices)) for t in w.tops], [pick(r) for r in w.routes])
        return self._window_outputs(w.reqs, w.tokens, w.logprobs, w.tops, w.routes)

    def _sampling_tensors(self, reqs: list[Request]) -> SamplingTensors:
        """The rows' sampling tensors; the last window's when the rows are the same requests."""
        rows, st = self._st_cache
        if len(rows) != len(reqs) or not all(a is b for a, b in zip(rows, reqs)):
            st = SamplingTensors.build([r.params for r in reqs], [r.seed for r in reqs], self.device)
            self._st_cache = (list(reqs), st)
        return st

    def _window_outputs(self, reqs: list[Request], out_tok, out_lp, tops: list, routes: list) -> list[RequestOutput]:
        """A decode window's tokens and logprobs [B, K] (and per-step top logprobs, routing) to the requests."""
        b, k = out_tok.shape
        toks, lps = out_tok.tolist(), out_lp.tolist()
        top_rows = None
        if tops:
            per_step = [_top_lists(t, [r.params.top_logprobs for r in reqs]) for t in tops]
            top_rows = [[per_step[j][i] for j in range(k)] for i in range(b)]
        route_rows = torch.stack(routes, 1).cpu() if routes else None  # [B, K, L, k]
        return [
            self._append(r, toks[i], lps[i], top_rows[i] if top_rows else None, route_rows[i] if route_rows is not None else None)
            for i, r in enumerate(reqs)
        ]

    def _append(self, req: Request, toks: list[int], lps: list[float], tops, routed=None) -> RequestOutput:
        """Give ``req`` its new tokens up to the first end condition; drop the rest."""
        params = req.params
        limit = final_len(req, self.max_model_len)
        take, reason, matched = len(toks), None, None
        n0, stop_ids = req.num_tokens, req.stop_ids
        for i, t in enumerate(toks):
            if t in stop_ids:
                take, reason, matched = i + 1, "stop", t
                break
            if n0 + i + 1 >= limit:
                take, reason = i + 1, "length"
                break
        if params.stop and self.detokenize is not None:
            base = len(req.output_ids)
            if (found := find_stop(self.detokenize, req.output_ids + toks[:take], base, params.stop)) is not None:
                take, reason, matched = found[0] - base + 1, "stop", found[1]
        new_ids, new_lps = toks[:take], lps[:take]
        prev_len = req.num_tokens
        req.output_ids += new_ids
        req.logprobs += new_lps
        if tops is not None:
            req.top_logprobs += tops[:take]
        if routed is not None:
            # routing of the tokens fed in this window: positions prev_len-1 .. ; keep those now in the cache
            keep = max(0, min(take, req.num_tokens - 1 - (prev_len - 1)))
            req.routed_experts.append(routed[:keep])
        if reason is not None:
            req.num_computed = req.num_tokens - 1
            self._finish(req, reason, matched)
        elif req.status is Status.RUNNING:
            req.num_computed = req.num_tokens - 1
        return RequestOutput(req.request_id, new_ids, new_lps, reason is not None, req)


@dataclass
class _Window:
    """A decode window enqueued on the device: its rows, and where its outputs land on the host."""

    reqs: list[Request]
    steps: int
    counters: torch.Tensor  # [B] device: output index of the window's first token per row
    tokens: torch.Tensor  # [B, K] host (pinned on CUDA), valid once ``done`` has fired
    logprobs: torch.Tensor  # [B, K]
    tops: list  # per step _Top (values [B, k], ids [B, k])
    routes: list  # per step [B, L, k] (MoE)
    done: torch.cuda.Event | None  # recorded after the copies (None on CPU: already there)


@dataclass
class _Top:
    values: torch.Tensor
    indices: torch.Tensor


def find_stop(detokenize: Callable[[list[int]], str], ids: list[int], start: int, stop: list[str]) -> tuple[int, str] | None:
    """The first index ``i >= start`` whose token completes a stop string in the text of ``ids``, and that string.

    A stop string first seen at token i ends inside that token's text, so the last ``tail`` tokens (at least a
    byte each, a character at most 4) hold it whole: decode those, not the whole output (quadratic in length).
    A tail that starts inside a character a byte-fallback tokenizer wrote as <0xNN> tokens decodes that whole run
    of bytes to U+FFFD: a tail with U+FFFD is decoded again from up to 3 tokens earlier, one start of which is the
    character's first byte."""
    tail = 4 * max(map(len, stop)) + 8
    for i in range(start, len(ids)):
        first = max(0, i + 1 - tail)
        for lo in range(first, max(-1, first - 4), -1):
            text = detokenize(ids[lo : i + 1])
            hit = next((s for s in stop if s in text), None)
            if hit is not None:
                return i, hit
            if "\ufffd" not in text:
                break
    return None


def _top_lists(top, ks: list[int]):
    """(values [B, k], ids [B, k]) -> per row a list of (id, logprob), cut to that row's k."""
    if top is None:
        return None
    vals, ids = top.values.tolist(), top.indices.tolist()
    return [list(zip(ids[i][: ks[i]], vals[i][: ks[i]])) for i in range(len(ks))]
