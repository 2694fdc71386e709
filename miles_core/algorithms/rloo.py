"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024,
"Back to Basics", arXiv:2402.14740).

For a group of G samples of one prompt:

    A_i = r_i - (1 / (G - 1)) * sum_{j != i} r_j  =  G / (G - 1) * (r_i - mean(r))

Groups may have different sizes; a group of one sample has no baseline and gets advantage 0
(departure: the paper assumes G >= 2). All-equal rewards give 0. Broadcast to the response
tokens. With ``kl_mode=reward``, r_i includes the KL penalty (returns.py).
Shapes: rewards [N], group_ids [N], response_mask [N, T] -> advantages [N, T].
"""

from __future__ import annotations

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.grpo import group_stats
from miles_core.algorithms.returns import sequence_rewards
from miles_core.types import AdvantageInputs, AdvantageOutputs


def rloo(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> AdvantageOutputs:
    r = sequence_rewards(inputs, cfg).float().double()  # exact group sums, as GRPO's: all-equal rewards give exactly 0
    sums, counts, _ = group_stats(r, inputs.group_ids)
    baseline = (sums - r) / (counts - 1).clamp(min=1)
    adv = ((r - baseline) * (counts > 1)).float()
    return AdvantageOutputs(advantages=adv[:, None] * inputs.response_mask)


rloo.needs_groups = True  # its baseline is the prompt group (check_algorithm refuses n_samples_per_prompt=1)
