"""Learning-rate schedule: linear warm-up, then constant or cosine decay.

For optimizer step ``s`` (0-based), peak ``lr``, ``w`` warm-up steps, ``D`` decay steps and a floor
``min_lr``:

    s < w:          lr * (s + 1) / w
    constant:       lr
    cosine:         min_lr + (lr - min_lr) * (1 + cos(pi * min(s - w, D) / D)) / 2

The schedule is a pure function of the step, so the scheduler state in a checkpoint is just the
trainer's step count.
"""

from __future__ import annotations

import math

from miles_core.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """``total_steps`` is the run's number of optimizer steps (used when lr_decay_steps is 0)."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay == "constant":
        return cfg.lr
    decay = cfg.lr_decay_steps or max(total_steps - cfg.lr_warmup_steps, 1)
    progress = min(step - cfg.lr_warmup_steps, decay) / decay
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
