"""GRPO advantages (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

For a group of G samples of one prompt with rewards r_1..r_G:

    A_i = (r_i - mean(r)) / (std(r) + eps)        (normalize_std=True)
    A_i =  r_i - mean(r)                          (normalize_std=False: Dr.GRPO, arXiv:2503.20783)

``std`` is the unbiased sample std (torch default); a group whose rewards are all equal gets
advantage 0, and so does a group of one sample. The sample's advantage is broadcast to all of its
response tokens. With ``kl_mode=reward``, r_i is the reward minus kl_coef times the sequence's
summed KL to the reference (see returns.py).
Shapes: rewards [N], group_ids [N], response_mask [N, T] -> advantages [N, T].
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.returns import sequence_rewards
from miles_core.types import AdvantageInputs, AdvantageOutputs

EPS = 1e-6


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group sum, group size, group index) per sample, for groups of any (uneven) sizes."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    return sums[inverse], counts[inverse].to(rewards.dtype), inverse


def group_normalized(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool) -> torch.Tensor:
    """Per-sample (r - group mean) [/ group std].

    The group statistics are taken in float64: a float32 reward times a group size below 2**29 is
    exact there, so a group whose rewards are all equal (0.7, say) has a mean equal to each reward and
    gets exactly 0. In float32 the mean is off by rounding, its std is that rounding (~1e-7), and
    dividing by std + 1e-6 gave the whole group a spurious advantage (0.056 for 7 samples of 0.7)."""
    rewards = rewards.float().double()
    sums, counts, inverse = group_stats(rewards, group_ids)
    centered = rewards - sums / counts
    if not normalize_std:
        return centered.float()
    sq = torch.zeros_like(rewards).index_add_(0, inverse, centered**2)  # one slot per sample: never fewer than groups
    var = sq[inverse] / (counts - 1).clamp(min=1)
    return (centered / (var.sqrt() + EPS)).float()


def grpo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs:
    adv = group_normalized(sequence_rewards(inputs, cfg), inputs.group_ids, cfg.normalize_std)
    return AdvantageOutputs(advantages=adv[:, None] * inputs.response_mask)


grpo.needs_groups = True  # its baseline is the prompt group (check_algorithm refuses n_samples_per_prompt=1)
