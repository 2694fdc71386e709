"""One generation request as the engine core tracks it, and what a step reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from miles_core.rollout.base import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not yet (or no longer, after preemption) holding KV pages
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field equality: requests are tracked in lists
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the request's own seed, or one drawn from the engine's generator
    stop_ids: frozenset[int]  # token ids that end the request (eos unless ignore_eos, + params.stop_token_ids)
    leader: Request | None = None  # a request of the same group that prefills the shared prompt first
    group_id: str | None = None  # the id the n > 1 samples of one add_request were made from (ids group_id-0, -1, ...)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # per token [layers, k] (MoE)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens found in the prefix cache at admission
    slot: int = -1  # row in the engine's per-sequence tables while running
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    weight_version: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilled(self) -> bool:
        """True once every token but the last sampled one is in the cache (it decodes next)."""
        return self.num_computed >= self.num_tokens - (1 if self.output_ids else 0)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What one :meth:`EngineCore.step` produced for one request."""

    request_id: str
    new_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    request: Request  # the full state (all tokens so far, finish reason)
