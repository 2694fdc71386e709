from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError


@dataclass
class RunConfig:
    name: str = "run"
    mode: str = "rl"  # rl: the RL loop | sft: supervised training only, on data.train_path (or the task's references)
    seed: int = 0  # (--seed)
    num_rollout: int = 20  # RL steps (--num-rollout)
    eval_every: int = 5  # held-out eval every N steps (and before the first and after the last)
    output_dir: str = "runs"  # each run writes to output_dir/<name>-<timestamp>/
    save: str | None = None  # (--save) checkpoints go to save/step_N (sharded, resumable), the final model to save/hf
    save_interval: int = 0  # (--save-interval) checkpoint every N RL steps; 0 = only at the end
    load: str | None = None  # (--load) an HF safetensors folder (weights), or a --save folder (resume)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int = 0  # torch CPU threads; 0 leaves torch's default

    def validate(self) -> None:
        if self.mode not in ("rl", "sft"):
            raise ConfigError(f"run.mode must be 'rl' or 'sft', got '{self.mode}'")
        if self.num_rollout < 0:
            raise ConfigError(f"run.num_rollout must be >= 0, got {self.num_rollout}")
        if self.save_interval < 0:
            raise ConfigError(f"run.save_interval must be >= 0, got {self.save_interval}")
        if self.eval_every < 1:
            raise ConfigError(f"run.eval_every must be >= 1, got {self.eval_every}")
