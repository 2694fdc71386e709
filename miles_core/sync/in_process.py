"""In-process weight sync: copy the trainer's tensors into the engine's model."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from miles_core.rollout.base import RolloutBackend


class InProcessTransport:
    def push(self, weights: Mapping[str, torch.Tensor], version: int, backend: RolloutBackend) -> None:
        backend.update_weights(weights, version)
