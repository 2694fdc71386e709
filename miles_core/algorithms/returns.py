"""Rewards per token and discounted returns, shared by the estimators.

* ``token_rewards``: [N, T] with the scalar reward R_i on the last response token of sample i and,
  when ``kl_mode=reward`` and ``kl_coef > 0``, the penalty ``-kl_coef * kl_t`` on every token
  (kl_t from :mod:`miles_core.algorithms.kl` between the rollout-time policy and the reference).
* ``sequence_rewards``: [N], the sum of ``token_rewards`` over each response, for estimators that
  work on one scalar per sample (GRPO, RLOO, REINFORCE++-baseline's group baseline).
* ``discounted_returns``: G_t = sum_{s >= t} gamma^(s - t) r_s within each response.
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.kl import kl_estimate
from miles_core.algorithms.masked import last_token_index
from miles_core.errors import ConfigError
from miles_core.types import AdvantageInputs


def kl_in_reward(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> torch.Tensor | None:
    """[N, T] per-token KL to the reference, or None when the KL is not a reward penalty."""
    if cfg.kl_mode != "reward" or cfg.kl_coef == 0:
        return None
    if inputs.ref_logprobs is None or inputs.old_logprobs is None:
        raise ConfigError("algorithm.kl_mode=reward needs reference logprobs; they are computed when algorithm.kl_coef > 0")
    return kl_estimate(inputs.old_logprobs, inputs.ref_logprobs, inputs.response_mask, cfg.kl_estimator_used)


def token_rewards(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> torch.Tensor:
    mask = inputs.response_mask
    out = torch.zeros_like(mask, dtype=torch.float32)
    rows = torch.arange(mask.shape[0], device=mask.device)
    has_tokens = mask.sum(-1) > 0
    out[rows, last_token_index(mask)] = inputs.rewards.float() * has_tokens
    kl = kl_in_reward(inputs, cfg)
    if kl is not None:
        out = out - cfg.kl_coef * kl
    return out * mask


def sequence_rewards(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> torch.Tensor:
    kl = kl_in_reward(inputs, cfg)
    rewards = inputs.rewards.float()
    return rewards if kl is None else rewards - cfg.kl_coef * kl.sum(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``rewards``, ``mask`` [N, T] -> returns [N, T]; masked-out positions pass the return through
    unchanged (a tool-output span inside a response does not break the discounting chain)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask
