"""The trainer interface the RL loop drives."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from miles_core.types import LossInputs, LossOutput, TrainBatch

LossFn = Callable[[LossInputs], LossOutput]


class Trainer(Protocol):
    model: torch.nn.Module

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per response token logprobs [N, T] under the current weights, without grad (zeros on padding)."""

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` (split into micro-batches), returning metrics."""

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The current weights to push to rollout engines (names as in the model)."""

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...
