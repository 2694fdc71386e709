"""Signatures of the two algorithm hooks' components."""

from __future__ import annotations

from typing import Protocol

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.types import AdvantageInputs, AdvantageOutputs, LossInputs, LossOutput


class AdvantageEstimator(Protocol):
    def __call__(self, inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs: ...


class PolicyLoss(Protocol):
    def __call__(self, inputs: LossInputs, cfg: AlgorithmConfig) -> LossOutput:
        """``LossOutput.loss`` is the per-token loss [N, T]; the trainer aggregates it over the
        global batch with ``cfg.loss_agg`` (see :mod:`miles_core.algorithms.aggregate`)."""
