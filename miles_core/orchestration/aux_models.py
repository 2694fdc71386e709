"""The models beside the policy, each built only when the algorithm needs it.

* ``ref``: a frozen copy of the policy at the start of RL (after any SFT warm-up), when
  ``algorithm.kl_coef > 0``. It is a second trainer of the same backend, so its logprobs come
  from exactly the code path of the policy's (``compute_logprobs``); its optimizer never steps.
* ``teacher``: the distillation teacher (``algorithm.teacher_checkpoint``), scored the same way.
* ``critic``: the PPO value model (miles_core/train/critic.py), for ``advantage_estimator=ppo``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from miles_core.train.critic import Critic


@dataclass
class AuxModels:
    ref: Any = None  # a Trainer used only for compute_logprobs
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


def build_aux_models(c, trainer) -> AuxModels:
    algo = c.ctx.config.algorithm
    aux = AuxModels()
    if algo.needs_reference:
        aux.ref = c.trainer_factory(c.ctx, _frozen(policy_snapshot(c, trainer)))
    if c.teacher is not None:
        aux.teacher = c.trainer_factory(c.ctx, _frozen(c.teacher))
    if algo.advantage_estimator == "ppo":
        aux.critic = Critic(policy_snapshot(c, trainer), c.ctx.config, c.ctx.device)
    return aux
