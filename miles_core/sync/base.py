from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from miles_core.rollout.base import RolloutBackend


class WeightTransport(Protocol):
    def push(self, weights: Mapping[str, torch.Tensor], version: int, backend: RolloutBackend) -> None:
        """Deliver ``weights`` to ``backend``; afterwards ``backend.weight_version == version``."""
