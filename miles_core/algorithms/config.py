from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum")


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = "grpo"  # (--advantage-estimator)
    policy_loss: str = "ppo_clip"
    normalize_std: bool = True  # GRPO: divide by the group std (False = Dr.GRPO)
    eps_clip: float = 0.2  # (--eps-clip) lower clip range
    eps_clip_high: float | None = None  # upper clip range (DAPO clip-higher); None = eps_clip
    kl_coef: float = 0.0  # (--kl-coef) weight of the KL-to-reference loss term
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_sum
    loss_agg_constant: float | None = None  # seq_sum divisor per sequence (Dr.GRPO); None = max response len

    def validate(self) -> None:
        if self.eps_clip < 0:
            raise ConfigError(f"algorithm.eps_clip must be >= 0, got {self.eps_clip}")
        if self.eps_clip_high is not None and self.eps_clip_high < 0:
            raise ConfigError(f"algorithm.eps_clip_high must be >= 0, got {self.eps_clip_high}")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ConfigError(
                f"algorithm.loss_agg must be one of {', '.join(LOSS_AGGREGATIONS)}, got '{self.loss_agg}'"
            )
