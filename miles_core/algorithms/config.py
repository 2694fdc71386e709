"""The ``algorithm`` section: which estimator and loss, and every knob they read.

Defaults reproduce plain GRPO + PPO-clip with no KL, no entropy bonus and no corrections.
docs/algorithms.md describes each key with the formula it enters.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum")
KL_ESTIMATORS = ("auto", "k1", "k2", "k3", "k3_clamped")
KL_MODES = ("loss", "reward")
MISMATCH_CORRECTIONS = ("none", "tis", "mis")
MISMATCH_LEVELS = ("token", "sequence")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"algorithm.{key} must be one of {', '.join(choices)}, got '{value}'")


def _at_least(key: str, value: float, low: float, strict: bool = False) -> None:
    if value < low or (strict and value == low):
        raise ConfigError(f"algorithm.{key} must be {'>' if strict else '>='} {low}, got {value}")


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = "grpo"  # (--advantage-estimator) a registered estimator
    policy_loss: str = "ppo_clip"  # a registered policy loss (ppo_clip, gspo, gspo_token, sft, ...)
    normalize_std: bool = True  # GRPO: divide by the group std (False = Dr.GRPO)
    # ---- PPO-clip / GSPO
    eps_clip: float = 0.2  # (--eps-clip) lower clip range
    eps_clip_high: float | None = None  # upper clip range (DAPO clip-higher); None = eps_clip
    clip_c: float | None = None  # dual-clip bound for negative advantages (> 1); None = off
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_sum
    loss_agg_constant: float | None = None  # seq_sum divisor per sequence (Dr.GRPO); None = rollout.max_response_len
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * entropy
    # ---- KL to the frozen reference policy (the policy at the start of RL)
    kl_coef: float = 0.0  # (--kl-coef: kl_mode=reward; --use-kl-loss --kl-loss-coef: kl_mode=loss) 0 = no reference model
    # auto: k1 as a reward penalty (the sample KL, as in REINFORCE++), k3 as a loss term. k3 as a
    # reward has a heavy tail (exp(-d)) that swamped 0/1 rewards in docs/algorithms.md's seed sweep
    kl_estimator: str = "auto"  # auto | k1 | k2 | k3 | k3_clamped
    kl_mode: str = "loss"  # loss: a loss term; reward: a per-token reward penalty
    # ---- discounted returns (PPO's GAE, REINFORCE++)
    gamma: float = 1.0
    lam: float = 0.95  # GAE lambda
    # ---- PPO critic (advantage_estimator=ppo)
    value_clip: float = 0.2  # clip range of the value update around the rollout-time value
    critic_lr: float | None = None  # None = train.lr
    # ---- rollout/train mismatch correction (rollout_logprobs vs the trainer's old_logprobs)
    mismatch_correction: str = "none"  # none | tis (truncate the weight) | mis (mask the token/sequence)
    mismatch_level: str = "token"  # token | sequence
    mismatch_cap: float = 2.0  # TIS: weights truncated at this value; MIS: upper bound kept
    mismatch_floor: float = 0.0  # MIS: lower bound kept
    # ---- DAPO extras
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill the batch
    dynamic_sampling_max_rounds: int = 3  # extra generation rounds to refill the batch
    overlong_buffer: int = 0  # DAPO soft overlong punishment window in tokens; 0 = off
    overlong_penalty: float = 1.0  # the penalty at max_response_len
    # ---- on-policy distillation
    teacher_checkpoint: str | None = None  # HF safetensors folder of the teacher
    distill_coef: float = 0.0  # weight of the reverse-KL advantage added to the RL advantage

    def validate(self) -> None:
        _at_least("eps_clip", self.eps_clip, 0)
        if self.eps_clip_high is not None:
            _at_least("eps_clip_high", self.eps_clip_high, 0)
        if self.clip_c is not None:
            _at_least("clip_c", self.clip_c, 1, strict=True)
        _choice("loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        if self.loss_agg_constant is not None:
            _at_least("loss_agg_constant", self.loss_agg_constant, 0, strict=True)
        _at_least("entropy_coef", self.entropy_coef, 0)
        _at_least("kl_coef", self.kl_coef, 0)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("kl_mode", self.kl_mode, KL_MODES)
        for key in ("gamma", "lam"):
            value = getattr(self, key)
            if not 0 <= value <= 1:
                raise ConfigError(f"algorithm.{key} must be in [0, 1], got {value}")
        _at_least("value_clip", self.value_clip, 0, strict=True)
        if self.critic_lr is not None:
            _at_least("critic_lr", self.critic_lr, 0, strict=True)
        _choice("mismatch_correction", self.mismatch_correction, MISMATCH_CORRECTIONS)
        _choice("mismatch_level", self.mismatch_level, MISMATCH_LEVELS)
        _at_least("mismatch_cap", self.mismatch_cap, 0, strict=True)
        _at_least("mismatch_floor", self.mismatch_floor, 0)
        if self.mismatch_floor >= self.mismatch_cap:
            raise ConfigError(
                f"algorithm.mismatch_floor ({self.mismatch_floor}) must be below algorithm.mismatch_cap ({self.mismatch_cap})"
            )
        _at_least("dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds, 0)
        _at_least("overlong_buffer", self.overlong_buffer, 0)
        _at_least("overlong_penalty", self.overlong_penalty, 0)
        _at_least("distill_coef", self.distill_coef, 0)
        if (self.advantage_estimator == "distill" or self.distill_coef > 0) and not self.teacher_checkpoint:
            raise ConfigError(
                "on-policy distillation needs a teacher: set algorithm.teacher_checkpoint to an HF safetensors folder"
            )

    @property
    def kl_estimator_used(self) -> str:
        """``kl_estimator`` with ``auto`` resolved for ``kl_mode``."""
        if self.kl_estimator != "auto":
            return self.kl_estimator
        return "k1" if self.kl_mode == "reward" else "k3"

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model is built only when some KL term uses it."""
        return self.kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        return self.advantage_estimator == "distill" or self.distill_coef > 0
