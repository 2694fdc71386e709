from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError


@dataclass
class RunConfig:
    name: str = "run"
    mode: str = "rl"  # rl: the RL loop | sft: supervised training only | rollout: generate and save rollouts, no training
    seed: int = 0  # (--seed)
    num_rollout: int = 20  # RL steps (--num-rollout)
    eval_every: int = 5  # held-out eval every N steps (and before the first and after the last)
    output_dir: str = "runs"  # each run writes to output_dir/<name>-<timestamp>/
    save: str | None = None  # (--save) checkpoints go to save/step_N (sharded, resumable), the final model to save/hf
    save_interval: int = 0  # (--save-interval) checkpoint every N RL steps; 0 = only at the end
    load: str | None = None  # (--load) an HF safetensors folder (weights), or a --save folder (resume)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_threads: int = 0  # torch CPU threads; 0 leaves torch's default
    resume: bool = False  # (--resume) continue from the newest checkpoint in run.save; an error if there is none
    save_rollouts: str | None = None  # (--save-rollouts) every step's samples as DIR/step_N.jsonl
    load_rollouts: str | None = None  # (--load-rollouts) train only, on DIR/step_N.jsonl; no engine is built

    def validate(self) -> None:
        if self.mode not in ("rl", "sft", "rollout"):
            raise ConfigError(f"run.mode must be 'rl', 'sft' or 'rollout', got '{self.mode}'")
        if self.resume and not self.save:
            raise ConfigError("--resume needs run.save (--save DIR): the folder whose newest checkpoint to continue")
        if self.load_rollouts and self.mode != "rl":
            raise ConfigError(f"run.load_rollouts trains on saved rollouts: it needs run.mode=rl, got '{self.mode}'")
        if not -(2**63) <= self.seed < 2**64:  # what torch.manual_seed takes
            raise ConfigError(f"run.seed must be in [-2**63, 2**64), got {self.seed}")
        if self.num_rollout < 0:
            raise ConfigError(f"run.num_rollout must be >= 0, got {self.num_rollout}")
        if self.save_interval < 0:
            raise ConfigError(f"run.save_interval must be >= 0, got {self.save_interval}")
        if self.eval_every < 1:
            raise ConfigError(f"run.eval_every must be >= 1, got {self.eval_every}")
        if self.num_threads < 0:  # under Ray it reached torch.set_num_threads in each actor, which died of it
            raise ConfigError(f"run.num_threads must be >= 0 (0 leaves torch's default), got {self.num_threads}")


@dataclass
class OrchestrationConfig:
    """Where the engines and the trainer run, and how rollout and training overlap."""

    placement: str = "local"  # local: one process | ray_colocated: engines and trainer share GPUs in turns | ray_disaggregated
    schedule: str = "sync"  # sync: on-policy | one_step_off: generate step k+1 while training on step k | async: partial rollouts
    max_staleness: int = 1  # async: drop groups whose oldest weights are more than this many versions behind the trainer
    num_engines: int = 1  # rollout engine actors (Ray placements)
    engine_num_cpus: float = 1.0  # per engine actor's placement-group bundle
    engine_num_gpus: float = 0.0
    trainer_num_cpus: float = 1.0
    trainer_num_gpus: float = 0.0
    trainer_num_ranks: int = 1  # trainer actors (Ray placements); > 1 = FSDP2 over them (gloo on CPU, NCCL on GPU)
    deterministic: bool = False  # per-sample sampling seeds from (run.seed, step, prompt index, sample index)
    ray_address: str | None = None  # None starts a local Ray cluster

    def validate(self) -> None:
        placements = ("local", "ray_colocated", "ray_disaggregated")
        if self.placement not in placements:
            raise ConfigError(f"orchestration.placement must be one of {', '.join(placements)}, got '{self.placement}'")
        if self.schedule not in ("sync", "one_step_off", "async"):
            raise ConfigError(f"orchestration.schedule must be 'sync', 'one_step_off' or 'async', got '{self.schedule}'")
        if self.max_staleness < 0:
            raise ConfigError(f"orchestration.max_staleness must be >= 0, got {self.max_staleness}")
        if self.schedule == "async" and self.placement != "local":
            raise ConfigError("orchestration.schedule=async runs in process for now: use orchestration.placement=local")
        if self.num_engines < 1:
            raise ConfigError(f"orchestration.num_engines must be >= 1, got {self.num_engines}")
        if self.trainer_num_ranks < 1:
            raise ConfigError(f"orchestration.trainer_num_ranks must be >= 1, got {self.trainer_num_ranks}")
        if self.placement == "local" and self.trainer_num_ranks != 1:
            raise ConfigError("orchestration.trainer_num_ranks > 1 needs a Ray placement (or launch with torchrun)")
        if self.placement == "ray_colocated" and self.trainer_num_ranks != 1:
            raise ConfigError("orchestration.trainer_num_ranks > 1 needs orchestration.placement=ray_disaggregated")
        if self.placement == "local" and self.num_engines != 1:
            raise ConfigError("orchestration.num_engines > 1 needs a Ray placement (orchestration.placement=ray_disaggregated)")
        self._validate_resources()

    def _validate_resources(self) -> None:
        """What Ray would refuse only once the run had started, with a ValueError traceback."""
        for key in ("engine_num_cpus", "engine_num_gpus", "trainer_num_cpus", "trainer_num_gpus"):
            if getattr(self, key) < 0:
                raise ConfigError(f"orchestration.{key} must be >= 0, got {getattr(self, key)}")
        if self.placement == "ray_colocated":  # one bundle for all: an engine or the trainer may ask for nothing
            if self.num_engines * self.engine_num_cpus + self.trainer_num_cpus == 0 and max(self.engine_num_gpus, self.trainer_num_gpus) == 0:
                raise ConfigError("the colocated bundle asks for no resources: set orchestration.engine_num_cpus, "
                                  "trainer_num_cpus or *_num_gpus > 0 (Ray refuses an empty bundle)")
        elif self.placement == "ray_disaggregated":  # a bundle each
            for who, key in (("an engine", "engine"), ("a trainer", "trainer")):
                if getattr(self, f"{key}_num_cpus") == 0 and getattr(self, f"{key}_num_gpus") == 0:
                    raise ConfigError(f"{who} actor asks for no resources: set orchestration.{key}_num_cpus or {key}_num_gpus > 0 "
                                      f"(its own bundle, which Ray refuses empty)")
