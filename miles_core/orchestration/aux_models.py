"""The models beside the policy, each built only when the algorithm needs it.

The KL reference is not here: the trainer owns it (``compute_ref_logprobs``, snapshotted by
``reset_reference`` when RL starts) so that it is sharded like the policy and saved in checkpoints.

* ``teacher``: the distillation teacher (``algorithm.teacher_checkpoint``), scored the same way.
* ``critic``: the PPO value model (miles_core/train/critic.py), for ``advantage_estimator=ppo``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from miles_core.train.critic import Critic


@dataclass
class AuxModels:
    teacher: Any = None
    critic: Critic | None = None


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def policy_snapshot(c, trainer) -> torch.nn.Module:
    """A detached copy of the policy holding the trainer's current weights."""
    model = copy.deepcopy(c.model)
    model.load_state_dict({k: v.detach().clone() for k, v in trainer.weights().items()})
    return model


def _scoring_only(ctx):
    """The run's context for a trainer that only scores (the teacher): ``kl_coef`` 0, so that it keeps no KL reference
    of its own (with the run's kl_coef > 0 a trainer deep-copies its model as one: a second teacher nobody reads)."""
    cfg = ctx.config
    return dataclasses.replace(ctx, config=dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, kl_coef=0.0)))


def build_aux_models(c, trainer) -> AuxModels:
    algo = c.ctx.config.algorithm
    aux = AuxModels()
    if c.teacher is not None:
        aux.teacher = c.trainer_factory(_scoring_only(c.ctx), _frozen(c.teacher))
    if algo.advantage_estimator == "ppo":
        aux.critic = Critic(policy_snapshot(c, trainer), c.ctx.config, c.ctx.device)
    return aux
