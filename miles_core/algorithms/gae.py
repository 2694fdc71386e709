"""PPO advantages with a learned critic: GAE (Schulman et al. 2016, arXiv:1506.02438) as used
for LLMs by Ouyang et al. 2022 (arXiv:2203.02155).

Token t of a response is the action taken in state s_t (prompt + first t response tokens); the
critic gives V_t = V(s_t). The per-token rewards r_t are the scalar reward on the last response
token, minus ``kl_coef * kl_t`` when ``kl_mode=reward`` (returns.py). Past the last token V = 0.

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = sum_l (gamma * lam)^l * delta_{t+l}
    returns_t = A_t + V_t            (the critic's regression targets)

The advantages are then whitened over every token of the batch (mean 0, std 1), as is usual
for PPO on LLMs. Masked-out tokens inside a response are skipped (the recursion passes over them).
Shapes: rewards [N], values [N, T], response_mask [N, T] -> advantages, returns [N, T].
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.masked import whiten
from miles_core.algorithms.returns import token_rewards
from miles_core.errors import ConfigError
from miles_core.types import AdvantageInputs, AdvantageOutputs


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation, [N, T] in, (advantages, returns) [N, T] out."""
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m, delta + gamma * lam * running, running)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = running
    adv = adv * mask
    return adv, (adv + values) * mask


def ppo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs:
    if inputs.values is None:
        raise ConfigError("advantage_estimator=ppo needs critic values; the loop builds the critic only for 'ppo'")
    mask = inputs.response_mask
    adv, returns = gae(token_rewards(inputs, cfg), inputs.values * mask, mask, cfg.gamma, cfg.lam)
    return AdvantageOutputs(advantages=whiten(adv, mask), returns=returns)
