"""Where the trainer and the rollout engines run (``orchestration.placement``).

* ``local``: both in this process (the trainer and backend factories, as registered).
* ``ray_disaggregated``: ``orchestration.num_engines`` engine actors and one trainer actor, each
  in its own bundle of one placement group (``*_num_cpus`` / ``*_num_gpus``).
* ``ray_colocated``: the same actors, but the engines and the trainer share one bundle's GPUs in
  turns: the engines release their weights and KV cache before training and reload them before
  the weight sync.

The loop only sees a trainer and a backend with the usual methods
(:mod:`miles_core.orchestration.ray_placement` holds the Ray facades).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from miles_core.errors import ConfigError


@dataclass
class Placement:
    trainer: Any
    backend: Any  # None in train-only mode (run.load_rollouts)
    colocated: bool = False
    _close: list = field(default_factory=list)

    @contextlib.contextmanager
    def training(self):
        """Around the trainer's work of a step: colocated engines give their memory back meanwhile."""
        if self.colocated and self.backend is not None:
            self.backend.release_memory()
            try:
                yield
            finally:
                self.backend.resume_memory()
        else:
            yield

    def close(self) -> None:
        try:
            if self.backend is not None:
                self.backend.shutdown()
        finally:  # the placement group, Ray and its temp folder go whatever the engines did
            for fn in self._close:
                fn()


def check_placement(cfg) -> None:
    o = cfg.orchestration
    if o.placement == "ray_colocated" and o.schedule != "sync":
        raise ConfigError("orchestration.placement=ray_colocated shares the GPUs in turns: it needs orchestration.schedule=sync")
    if o.schedule == "async" and cfg.rollout.backend == "sglang":  # here, not when the loop makes the schedule (after the warm-up)
        raise ConfigError("orchestration.schedule=async drives the built-in engine in process: use rollout.backend=builtin "
                          "(with rollout.backend=sglang, orchestration.schedule=one_step_off overlaps rollout and training)")
    if o.placement != "local" and (cfg.algorithm.needs_teacher or cfg.algorithm.advantage_estimator == "ppo"):
        raise ConfigError("Ray placements do not run a teacher or a critic yet; use orchestration.placement=local")
    if o.placement != "local" and cfg.run.mode == "sft":
        raise ConfigError("run.mode=sft runs in process; use orchestration.placement=local")
    if o.placement != "local" and cfg.sync.transport in ("disk", "distributed", "sglang_tensor"):
        # the driver's proxy of the engine actors takes weights only as tensors (through Ray's object store)
        raise ConfigError(f"orchestration.placement={o.placement} sends weights to its engine actors through Ray: "
                          f"use sync.transport=in_process, not {cfg.sync.transport}")


def make_placement(c) -> Placement:
    cfg = c.ctx.config
    check_placement(cfg)
    need_backend = not cfg.run.load_rollouts
    need_trainer = cfg.run.mode != "rollout"
    if cfg.orchestration.placement == "local":
        trainer = c.trainer_factory(c.ctx, c.model) if need_trainer else None
        backend = c.backend_factory(c.ctx, c.model) if need_backend else None
        return Placement(trainer, backend)
    from miles_core.orchestration.ray_placement import ray_placement

    return ray_placement(c, need_trainer, need_backend)
