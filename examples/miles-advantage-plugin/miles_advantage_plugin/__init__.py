"""A Miles plugin that adds one advantage estimator, ``median_baseline``.

    A_i = r_i - median{r_j : j in the group of i}       (broadcast to the response tokens)

Shapes: rewards [N], group_ids [N], response_mask [N, T] -> advantages [N, T]. For a group of
even size, torch's median is the lower of the two middle values. A group whose rewards are all
equal, or a group of one, gets 0.
"""

from __future__ import annotations

import torch

from miles_core.hookspecs import hookimpl
from miles_core.types import AdvantageInputs, AdvantageOutputs

__version__ = "0.1.0"


def median_baseline(inputs: AdvantageInputs, cfg) -> AdvantageOutputs:
    rewards = inputs.rewards.float()
    adv = torch.zeros_like(rewards)
    for g in torch.unique(inputs.group_ids):
        sel = inputs.group_ids == g
        adv[sel] = rewards[sel] - rewards[sel].median()
    return AdvantageOutputs(advantages=adv[:, None] * inputs.response_mask)


median_baseline.needs_groups = True  # its baseline is the group: a run with one sample per prompt is refused


@hookimpl
def miles_register_advantage_estimators(registry) -> None:
    registry.add("median_baseline", median_baseline)
