"""The whole run's configuration: one section per stage, each defined beside its component."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.data.config import DataConfig
from miles_core.models.config import ModelConfig
from miles_core.orchestration.config import OrchestrationConfig, RunConfig
from miles_core.rewards.config import RewardConfig
from miles_core.rollout.config import RolloutConfig
from miles_core.sync.config import SyncConfig
from miles_core.train.config import TrainConfig


@dataclass
class MilesConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)

    def validate(self) -> None:
        for f in fields(self):
            getattr(self, f.name).validate()
