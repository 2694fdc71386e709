"""REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262).

REINFORCE++: per-token rewards r_t = R_i [t = last] - kl_coef * kl_t (the KL to the reference
enters the reward when ``kl_mode=reward``; with ``kl_mode=loss`` it is a loss term instead), then
discounted returns and whitening over every token of the global batch:

    G_t = sum_{s >= t} gamma^(s - t) r_s          A = (G - mean_batch(G)) / std_batch(G)

REINFORCE++-baseline: the group mean is subtracted from each scalar reward first
(R_i - mean_group(R)), then the same KL-shaped returns; the batch normalization divides by the
batch std without re-centring (the group baseline already centres the rewards).

A batch whose every reward is equal (and no KL) gives all-zero advantages rather than 0/0.
Shapes: rewards [N], response_mask [N, T] (old/ref logprobs [N, T] for the KL) -> advantages [N, T].
"""

from __future__ import annotations

from dataclasses import replace

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.grpo import group_normalized
from miles_core.algorithms.masked import whiten
from miles_core.algorithms.returns import discounted_returns, token_rewards
from miles_core.types import AdvantageInputs, AdvantageOutputs


def reinforce_plus_plus(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs:
    mask = inputs.response_mask
    returns = discounted_returns(token_rewards(inputs, cfg), mask, cfg.gamma)
    return AdvantageOutputs(advantages=whiten(returns, mask))


def reinforce_plus_plus_baseline(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs:
    mask = inputs.response_mask
    centered = group_normalized(inputs.rewards, inputs.group_ids, normalize_std=False)
    shaped = token_rewards(replace(inputs, rewards=centered), cfg)
    returns = discounted_returns(shaped, mask, cfg.gamma)
    return AdvantageOutputs(advantages=whiten(returns, mask, shift_mean=False))


reinforce_plus_plus_baseline.needs_groups = True  # its baseline is the prompt group (check_algorithm refuses n_samples_per_prompt=1)
