"""On-policy distillation: per-token reverse KL to a teacher on the student's own samples
(Agarwal et al. 2024, GKD, arXiv:2306.13649; Gu et al. 2024, MiniLLM, arXiv:2306.08543;
Thinking Machines, "On-Policy Distillation", 2025).

The student pi samples y; the teacher scores the same tokens. The reverse KL
KL(pi || teacher) = E_pi[log pi(y_t) - log teacher(y_t)] is minimised by policy gradient with the
per-token advantage

    A_t = log teacher(y_t) - log pi_old(y_t)          (the negated k1 estimate, no discounting)

* ``advantage_estimator=distill``: A_t alone (no reward needed); with ``kl_mode=reward`` and ``kl_coef > 0``
  minus ``kl_coef * kl_t`` to the reference, the per-token reward penalty (returns.py), also undiscounted.
* ``distill_coef > 0`` with any other estimator: A_rl + distill_coef * A_t.

Departure from GKD: no mixing with teacher-generated or dataset sequences (purely on-policy),
and the KL is the sampled-token estimate, not the full-vocabulary divergence.
Shapes: old_logprobs, teacher_logprobs, response_mask [N, T] -> advantages [N, T].
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.returns import kl_in_reward
from miles_core.errors import ConfigError
from miles_core.types import AdvantageInputs, AdvantageOutputs


def reverse_kl_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    if inputs.teacher_logprobs is None or inputs.old_logprobs is None:
        raise ConfigError("on-policy distillation needs teacher logprobs: set algorithm.teacher_checkpoint")
    return (inputs.teacher_logprobs - inputs.old_logprobs) * inputs.response_mask


def distill(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs:
    adv = reverse_kl_advantage(inputs)
    kl = kl_in_reward(inputs, cfg)  # else kl_mode=reward built and scored a reference that changed nothing
    return AdvantageOutputs(advantages=adv if kl is None else adv - cfg.kl_coef * kl)


def add_distillation(out: AdvantageOutputs, inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs:
    """The RL advantage plus ``distill_coef`` times the reverse-KL advantage (no-op when 0)."""
    if cfg.distill_coef == 0 or cfg.advantage_estimator == "distill":
        return out
    return AdvantageOutputs(out.advantages + cfg.distill_coef * reverse_kl_advantage(inputs), out.returns)
