"""The built-in rollout engine: batched generation with a KV cache, in process.

Prompts of a batch are left-padded so that every row's next token sits in the same column; a
boolean mask hides the padding. The engine owns a copy of the policy and takes new weights
through :meth:`update_weights` (the in-process weight transport).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from miles_core.data.tokenizer import Tokenizer
from miles_core.models.decoder import KVCache
from miles_core.precision.base import PrecisionRecipe
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.sampling import sample_next
from miles_core.types import Prompt, Sample


class BuiltinEngine:
    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, device: torch.device, max_batch_size: int = 512, seed: int = 0,
        precision: PrecisionRecipe | None = None, logprobs_op: Callable[..., Any] | None = None,
    ):
        self.model = copy.deepcopy(model).to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = device
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.weight_version = 0
        # with a batch-invariant recipe, forwards run inside its kernel mode and the reported
        # logprobs come from the trainer's own "logprobs" op (bitwise equal to training's)
        self.precision = precision
        self.logprobs_op = logprobs_op if precision is not None and precision.batch_invariant else None

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        own = self.model.state_dict()
        for name, tensor in state_dict.items():
            own[name].copy_(tensor)
        self.weight_version = version

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[Sample]:
        rows = [(gi, p) for gi, p in enumerate(prompts) for _ in range(n)]
        out: list[Sample] = []
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            with self.precision.kernel_mode(self.device) if self.precision else contextlib.nullcontext():
                out.extend(self._generate_batch(chunk, params, generator, start))
        return out

    @torch.no_grad()
    def _generate_batch(self, rows, params: SamplingParams, generator, offset: int) -> list[Sample]:
        model, dev = self.model, self.device
        tok = self.tokenizer
        stop_ids = set(params.stop_token_ids) | {tok.eos_token_id}
        prompt_ids = [p.prompt_ids or tok.encode(p.text) for _, p in rows]
        b = len(rows)
        plen = max(len(ids) for ids in prompt_ids)
        total = plen + params.max_new_tokens
        ids = torch.full((b, plen), tok.pad_token_id, dtype=torch.long, device=dev)
        valid = torch.zeros((b, total), dtype=torch.bool, device=dev)
        for i, p_ids in enumerate(prompt_ids):
            ids[i, plen - len(p_ids) :] = torch.tensor(p_ids, device=dev)
            valid[i, plen - len(p_ids) : plen] = True
        positions = (valid[:, :plen].long().cumsum(-1) - 1).clamp(min=0)
        dtype = next(model.parameters()).dtype
        cache = KVCache(model.config, b, total, dev, dtype)
        causal = torch.ones(plen, plen, dtype=torch.bool, device=dev).tril()
        mask = (causal[None] & valid[:, None, :plen])[:, None]  # [B, 1, T, T]
        # rows that are all padding (cannot happen for real prompts) would give NaN: keep the diagonal
        mask = mask | torch.eye(plen, dtype=torch.bool, device=dev)[None, None]
        hidden = model(ids, positions, mask, cache)[:, -1]
        next_pos = positions[:, -1] + 1
        new_tokens = torch.zeros((b, params.max_new_tokens), dtype=torch.long, device=dev)
        new_logps = torch.zeros((b, params.max_new_tokens), dtype=torch.float32, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        lengths = torch.full((b,), params.max_new_tokens, dtype=torch.long, device=dev)
        stop_tensor = torch.tensor(sorted(stop_ids), device=dev)
        finish = ["length"] * b
        for t in range(params.max_new_tokens):
            logits = model.lm_head(hidden)
            token, logp = sample_next(logits, params.temperature, params.top_p, params.top_k, generator)
            if self.logprobs_op is not None:
                temp = params.temperature if params.temperature > 0 else 1.0
                logp = self.logprobs_op(hidden, model.lm_head.weight, token, temperature=temp)[0]
            token = torch.where(done, torch.full_like(token, tok.pad_token_id), token)
            new_tokens[:, t] = token
            new_logps[:, t] = torch.where(done, torch.zeros_like(logp), logp)
            hit = ~done & torch.isin(token, stop_tensor)
            lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
            for i in hit.nonzero().flatten().tolist():
                finish[i] = "stop"
            if params.stop:
                for i in (~done & ~hit).nonzero().flatten().tolist():
                    text = tok.decode(new_tokens[i, : t + 1].tolist())
                    if any(s in text for s in params.stop):
                        hit[i] = True
                        lengths[i] = t + 1
                        finish[i] = "stop"
            done = done | hit
            if bool(done.all()) or t + 1 == params.max_new_tokens:
                break
            valid[:, plen + t] = True
            step_mask = valid[:, None, None, : plen + t + 1]
            hidden = model(token[:, None], next_pos[:, None], step_mask, cache)[:, -1]
            next_pos = next_pos + 1
        samples = []
        toks, lps, lens = new_tokens.tolist(), new_logps.tolist(), lengths.tolist()
        for i, (group, prompt) in enumerate(rows):
            resp = toks[i][: lens[i]]
            samples.append(
                Sample(
                    prompt=prompt.text,
                    prompt_ids=list(prompt_ids[i]),
                    response_ids=resp,
                    response=tok.decode([t for t in resp if t not in stop_ids]),
                    rollout_logprobs=lps[i][: lens[i]],
                    label=prompt.label,
                    group_id=group,
                    index=offset + i,
                    finish_reason=finish[i],
                    weight_version=self.weight_version,
                    metadata=dict(prompt.metadata),
                )
            )
        return samples
