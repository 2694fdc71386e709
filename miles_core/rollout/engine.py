"""The built-in rollout backend: the engine core (continuous batching, paged KV, prefix sharing,
CUDA graphs; see :mod:`miles_core.rollout.engine_core`) behind the :class:`RolloutBackend` interface.

The engine owns a copy of the policy and takes new weights through :meth:`update_weights` (the
in-process weight transport). ``generate`` queues every prompt as a group of ``n`` samples, which
share the prompt's KV pages, and steps the core until all are done.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from miles_core.data.tokenizer import Tokenizer
from miles_core.errors import DataError
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore
from miles_core.rollout.engine_core.request import Request
from miles_core.types import Prompt, Sample


def trim_stop(text: str, stop: list[str]) -> str:
    """The response text up to the first stop string (SGLang leaves the stop string out)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class BuiltinEngine:
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        device: torch.device,
        max_batch_size: int = 512,
        seed: int = 0,
        config: EngineConfig | None = None,
        dtype: torch.dtype | None = None,
        precision=None,
        kernels=None,
    ):
        model = copy.deepcopy(model).to(device)
        if dtype is not None:
            model = model.to(dtype)
        if kernels is not None and hasattr(model, "use_kernels"):  # the trainer's rmsnorm/rope/swiglu
            model.use_kernels(kernels)
        cfg = config or EngineConfig(max_num_seqs=min(max_batch_size, 256))
        if device.type == "cpu" and config is None:
            cfg.decode_steps = 8
        exact = precision is not None and precision.batch_invariant
        if exact:  # the kernel mode must see the trainer's attention call (a copy: the caller's config stays)
            cfg = dataclasses.replace(cfg, exact_attention=True)
        self.tokenizer = tokenizer
        self.device = device
        self.precision = precision  # its kernel_mode wraps every engine step (a plugin's batch-invariant mode)
        eos = getattr(tokenizer, "stop_token_ids", None)  # an HF model's own eos ids too (Llama 3 Instruct's <|eot_id|>)
        if eos is None:
            eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
        op = kernels["logprobs"] if exact and kernels is not None else None  # the trainer's op, for bitwise logprobs
        self.core = EngineCore(
            model, cfg, eos_token_ids=eos, detokenize=tokenizer.decode, seed=seed,
            logprobs_op=op, logprobs_dtype=precision.compute_dtype if exact else None,
            special_token_id=getattr(tokenizer, "special_token_id", None),
        )
        self.model = self.core.model
        self._abort_requested = False  # set by abort_all() from another thread

    @property
    def weight_version(self) -> int:
        return self.core.weight_version

    # ------------------------------------------------------------------ sampling state (checkpoints)
    def get_rng_state(self) -> object:
        """The state of the generator that draws each unseeded request's sampling seed."""
        return self.core.rng.getstate()

    def set_rng_state(self, state: object) -> None:
        self.core.rng.setstate(state)

    # ------------------------------------------------------------------ weights
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.core.update_weights(state_dict, version)

    def update_weights_from_disk(self, path: str | Path, version: int) -> None:
        self.core.update_weights_from_disk(path, version)

    def release_memory(self, tags=("weights", "kv_cache")) -> None:
        self.core.release_memory(tags)

    def resume_memory(self, tags=("weights", "kv_cache")) -> None:
        self.core.resume_memory(tags)

    def abort_all(self) -> None:
        """Abort every running request (from another thread): a running ``generate`` returns them
        with the tokens sampled so far and ``finish_reason="abort"``. Takes effect between engine steps."""
        self._abort_requested = True

    def shutdown(self) -> None:
        for rid in list(self.core.requests):
            self.core.abort(rid)
        self.core.step()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[Sample]:
        tok = self.tokenizer
        groups: list[list[Request]] = []
        for p in prompts:
            ids = p.prompt_ids or tok.encode(p.text)
            seed = p.metadata.get("sampling_seed")  # deterministic mode (miles_core.orchestration.seeds)
            try:
                groups.append(self.core.add_request(ids, params if seed is None else dataclasses.replace(params, seed=seed), n=n))
            except DataError as exc:  # refused (too long for the engine, say): none of the batch runs, the prompt is named
                for r in (r for g in groups for r in g):
                    self.core.abort(r.request_id)
                raise DataError(f"rollout prompt {p.text[:60]!r}{'...' if len(p.text) > 60 else ''}: {exc}") from None
        mode = self.precision.kernel_mode(self.device) if self.precision is not None else contextlib.nullcontext()
        self._abort_requested = False
        with mode:
            while self.core.has_unfinished():
                if self._abort_requested:
                    for rid in list(self.core.requests):
                        self.core.abort(rid)
                self.core.step()
        samples = []
        for gi, (prompt, reqs) in enumerate(zip(prompts, groups)):
            for r in reqs:
                resp = [t for t in r.output_ids if t not in r.stop_ids]
                text = tok.decode(resp)
                samples.append(
                    Sample(
                        prompt=prompt.text,
                        prompt_ids=list(r.prompt_ids),
                        response_ids=list(r.output_ids),
                        response=trim_stop(text, params.stop) if params.stop else text,
                        rollout_logprobs=list(r.logprobs),
                        label=prompt.label,
                        group_id=gi,
                        index=len(samples),
                        finish_reason=r.finish_reason or "abort",
                        weight_version=r.weight_version,
                        routed_experts=torch.cat(r.routed_experts) if r.routed_experts else None,
                        metadata=dict(prompt.metadata),
                    )
                )
        return samples
