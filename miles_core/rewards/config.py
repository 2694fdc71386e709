from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError


@dataclass
class RewardConfig:
    # "task" (the task's verifier), a registered reward, or a user function "module:function" (or slime's
    # --custom-rm-path form, "module.function", when no registered reward has that name)
    name: str = "task"
    timeout_s: float = 30.0  # per sample, for async reward functions

    def validate(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
