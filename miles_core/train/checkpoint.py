"""Sharded trainer checkpoints with torch.distributed.checkpoint (DCP).

``save_trainer(dir)`` writes, from every rank, the policy and optimizer state (each rank its own
shards; ``get_state_dict`` names the optimizer state by parameter name, so a checkpoint saved on
W ranks loads on any number of ranks), the frozen reference model when there is one, and
``trainer.json`` (the scheduler's step count). Atomicity (tmp dir + rename) is the caller's:
see miles_core/orchestration/checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from miles_core.errors import ConfigError
from miles_core.train.distributed import barrier

if TYPE_CHECKING:
    from miles_core.train.torch_trainer import TorchTrainer

TRAINER_META = "trainer.json"


# torch.distributed.checkpoint is imported where it is used: it pulls in DTensor (~1 s of every
# `miles` command's start-up on a CPU machine) and only a save or a load needs it.


def _state(trainer: TorchTrainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.policy, trainer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if trainer.ref is not None:
        state["ref"] = get_model_state_dict(trainer.ref)
    return state


def save_trainer(path: Path, trainer: TorchTrainer) -> None:
    import torch.distributed.checkpoint as dcp

    path.mkdir(parents=True, exist_ok=True)
    dcp.save(_state(trainer), checkpoint_id=str(path))
    if trainer.dist.is_main:
        meta = {"step": trainer.step, "world_size": trainer.dist.world_size, "has_ref": trainer.ref is not None}
        (path / TRAINER_META).write_text(json.dumps(meta))
    barrier()


def load_trainer(path: Path, trainer: TorchTrainer) -> None:
    meta_file = path / TRAINER_META
    if not meta_file.is_file():
        if any(path.glob("trainer*.pt")):  # the Megatron trainer's files (train/megatron/trainer.py)
            raise ConfigError(f"'{path}' was saved by train.backend=megatron; resume it with train.backend=megatron")
        raise ConfigError(f"'{path}' is not a trainer checkpoint (no {TRAINER_META}); point run.load at a --save folder")
    meta = json.loads(meta_file.read_text())
    if meta["has_ref"] != (trainer.ref is not None):
        raise ConfigError(
            f"'{path}' was saved {'with' if meta['has_ref'] else 'without'} a reference model; "
            f"resume with the same algorithm.kl_coef (> 0 keeps a reference model)"
        )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(trainer.policy, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if trainer.ref is not None:
        set_model_state_dict(trainer.ref, state["ref"])
    trainer.step = int(meta["step"])
