from __future__ import annotations

from dataclasses import dataclass, field

from miles_core.errors import ConfigError
from miles_core.train.megatron.config import MegatronConfig


@dataclass
class TrainConfig:
    backend: str = "torch"  # a registered trainer
    precision: str = "fp32"  # a registered precision recipe
    lr: float = 1e-3  # (--lr)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    micro_batch_size: int = 64  # at most this many samples per forward/backward
    max_tokens_per_micro_batch: int = 8192  # token budget of one packed micro-batch (no padding)
    activation_checkpointing: bool = False  # recompute each decoder block in backward
    compile: bool = False  # torch.compile each decoder block (dynamic shapes); it then keeps the core's torch norm/rope/swiglu for inductor to fuse
    attention: str = "auto"  # packed attention: auto | sdpa (per sample) | padded (one batched call) | varlen (flash, CUDA) | cudnn (padded, cuDNN, CUDA)
    logprob_chunk_size: int = 1024  # rows of [tokens, vocab] logits made at once by the "logprobs" op
    lr_warmup_steps: int = 0  # linear warm-up over this many optimizer steps
    lr_decay: str = "constant"  # constant | cosine (after warm-up)
    lr_decay_steps: int = 0  # cosine length; 0 = the rest of the run
    min_lr: float = 0.0  # cosine floor
    updates_per_rollout: int = 1  # optimizer steps per rollout batch (the batch is split evenly)
    # auto: when nothing reads the old-policy logprobs before training (one optimizer step per rollout,
    # no KL reference, teacher or critic, an estimator without needs_old_logprobs), the training forward's
    # own logprobs, detached, stand in for them: the same numbers a separate pass would give, one forward
    # pass fewer. recompute: always a pass.
    old_logprobs: str = "auto"
    sft_warmup_steps: int = 0  # supervised steps on the task's reference answers before RL
    sft_batch_size: int = 64
    sft_lr: float | None = None  # None = lr
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # train.backend=megatron only

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        for key in ("adam_beta1", "adam_beta2"):  # AdamW's own range; a resume sets them on its groups unchecked
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"train.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.grad_clip < 0:  # the trainers take any value <= 0 for no clipping; only 0 is documented as that
            raise ConfigError(f"train.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if self.min_lr < 0:  # the cosine schedule would end on a negative rate: gradient ascent
            raise ConfigError(f"train.min_lr must be >= 0, got {self.min_lr}")
        if self.lr_decay == "cosine" and self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr ({self.min_lr}) must not exceed train.lr ({self.lr}): the cosine decays from lr to min_lr")
        if self.old_logprobs not in ("auto", "recompute"):
            raise ConfigError(f"train.old_logprobs must be auto or recompute, got {self.old_logprobs!r}")
        if self.micro_batch_size < 1:
            raise ConfigError(f"train.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch < 1:
            raise ConfigError(f"train.max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.attention not in ("auto", "sdpa", "padded", "varlen", "cudnn"):
            raise ConfigError(f"train.attention must be auto, sdpa, padded, varlen or cudnn, got '{self.attention}'")
        if self.lr_decay not in ("constant", "cosine"):
            raise ConfigError(f"train.lr_decay must be constant or cosine, got '{self.lr_decay}'")
        if self.lr_warmup_steps < 0 or self.lr_decay_steps < 0:
            raise ConfigError("train.lr_warmup_steps and train.lr_decay_steps must be >= 0")
        if self.logprob_chunk_size < 1:
            raise ConfigError(f"train.logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        if self.updates_per_rollout < 1:
            raise ConfigError(f"train.updates_per_rollout must be >= 1, got {self.updates_per_rollout}")
        if self.sft_warmup_steps < 0:
            raise ConfigError(f"train.sft_warmup_steps must be >= 0, got {self.sft_warmup_steps}")
        if self.sft_batch_size < 1:
            raise ConfigError(f"train.sft_batch_size must be >= 1, got {self.sft_batch_size}")
        if self.sft_lr is not None and self.sft_lr <= 0:
            raise ConfigError(f"train.sft_lr must be > 0 (or null: train.lr), got {self.sft_lr}")
        if self.backend == "megatron":
            self.megatron.validate()
