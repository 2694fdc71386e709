"""Data that crosses a stage boundary of the loop.

Token ids travel end to end: the rollout backend returns the ids it sampled and the trainer
trains on exactly those ids; model output is never re-tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Prompt:
    """One prompt from a prompt source, before generation."""

    text: str
    label: Any = None  # whatever the task's verifier needs (the reference answer)
    prompt_ids: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # where it came from ("path:line" of a JSONL row), for errors found after start-up


@dataclass
class Sample:
    """One generated response to one prompt, as it flows from rollout to training."""

    prompt: str
    prompt_ids: list[int]
    response_ids: list[int]
    response: str
    rollout_logprobs: list[float]  # per response token, from the engine that sampled it; [] when it gave none
    label: Any = None
    group_id: int = 0  # samples of the same prompt share a group id
    index: int = 0  # position of the sample in its step's batch
    finish_reason: str = "length"  # "stop" | "length" | "abort"
    weight_version: int = 0  # the engine's weight version when the sample was generated
    reward: float | None = None
    loss_mask: list[int] | None = None  # per response token; None means all ones
    routed_experts: Any = None  # optional MoE routing recorded by the engine (R3)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass
class TrainBatch:
    """A padded batch of samples, ready for the trainer.

    Shapes: ``N`` samples, ``L`` = longest prompt+response, ``T`` = longest response.
    Response tensors are aligned so that ``response_*[i, t]`` describes the t-th generated token
    of sample i.
    """

    input_ids: torch.Tensor  # [N, L] int64, right padded with pad_id
    prompt_lens: torch.Tensor  # [N] int64
    response_lens: torch.Tensor  # [N] int64
    response_mask: torch.Tensor  # [N, T] float, 1 where a response token is trained on
    advantages: torch.Tensor  # [N, T] float
    # [N, T] float, logprobs under the policy that sampled (trainer-side); None: the trainer takes its
    # training forward's own, detached (on-policy, train.old_logprobs=auto)
    old_logprobs: torch.Tensor | None
    # [N, T] float, logprobs reported by the rollout engine; None when a sample has none (saved rollouts without
    # them, a backend that gives none): zeros there would read as probability 1 to the mismatch weights and metrics
    rollout_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None = None  # [N, T], frozen reference model
    returns: torch.Tensor | None = None  # [N, T], value targets (PPO)
    values: torch.Tensor | None = None  # [N, T], critic values at rollout time (PPO)
    teacher_logprobs: torch.Tensor | None = None  # [N, T], on-policy distillation

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, idx: torch.Tensor | slice) -> "TrainBatch":
        """The sub-batch of the samples at ``idx`` (used to cut micro-batches)."""
        kwargs = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            kwargs[name] = value[idx] if isinstance(value, torch.Tensor) else value
        return TrainBatch(**kwargs)


@dataclass
class AdvantageInputs:
    """What an advantage estimator sees. ``N`` samples, ``T`` = longest response."""

    rewards: torch.Tensor  # [N] float, one scalar reward per sample
    group_ids: torch.Tensor  # [N] int64, samples of one prompt share a group id
    response_mask: torch.Tensor  # [N, T] float
    old_logprobs: torch.Tensor | None = None  # [N, T]; None unless needed (an estimator's needs_old_logprobs)
    ref_logprobs: torch.Tensor | None = None  # [N, T]
    values: torch.Tensor | None = None  # [N, T], critic estimates (PPO)
    teacher_logprobs: torch.Tensor | None = None  # [N, T], on-policy distillation


@dataclass
class AdvantageOutputs:
    advantages: torch.Tensor  # [N, T], zero where response_mask is zero
    returns: torch.Tensor | None = None  # [N, T], value targets when the estimator has a critic


@dataclass
class LossInputs:
    """What a policy loss sees. ``N`` samples in the micro-batch, ``T`` = longest response."""

    logprobs: torch.Tensor  # [N, T], current policy, with grad
    old_logprobs: torch.Tensor  # [N, T], policy that produced the samples (no grad)
    advantages: torch.Tensor  # [N, T]
    response_mask: torch.Tensor  # [N, T]
    rollout_logprobs: torch.Tensor | None = None  # [N, T], engine-side logprobs
    ref_logprobs: torch.Tensor | None = None  # [N, T]
    entropy: torch.Tensor | None = None  # [N, T]
    teacher_logprobs: torch.Tensor | None = None  # [N, T]


@dataclass
class LossOutput:
    loss: torch.Tensor  # [N, T] per-token loss; the trainer aggregates it (algorithm.loss_agg)
    metrics: dict[str, float] = field(default_factory=dict)
