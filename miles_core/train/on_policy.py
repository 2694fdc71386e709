"""Old-policy logprobs taken from the training forward itself (``train.old_logprobs=auto``).

With one optimizer step per rollout batch, the weights that sampled (after the last weight sync) are
the weights of every micro-batch of the step, so ``old_logprobs = logprobs.detach()``: the ratio
``exp(logprobs - old_logprobs)`` is 1 in value and has the policy gradient's derivative, exactly as
with a separate no-grad pass, which this saves. The engine-vs-trainer mismatch that the loop reports
from the separate pass is accumulated here instead.
"""

from __future__ import annotations

import torch

from miles_core.algorithms.mismatch import mismatch_metrics
from miles_core.types import TrainBatch


def on_policy_old(logprobs: torch.Tensor, mb: TrainBatch, mask: torch.Tensor, num_tokens: int, sums: dict[str, float]) -> torch.Tensor:
    """The micro-batch's old logprobs [n, T]: ``mb.old_logprobs`` when given, else ``logprobs``
    detached, adding that micro-batch's share of mismatch_kl / mismatch_k1 / mismatch_abs to ``sums``
    (token-weighted, so that the step's sums are means over all its response tokens; none without
    ``mb.rollout_logprobs``)."""
    if mb.old_logprobs is not None:
        return mb.old_logprobs.to(logprobs.device)
    old = logprobs.detach()
    if mb.rollout_logprobs is None:
        return old
    with torch.no_grad():
        rollout = mb.rollout_logprobs.to(old.device)
        share = float(mask.sum()) / max(num_tokens, 1)
        for key, value in mismatch_metrics(old, rollout, mask).items():
            sums[key] += value * share
        sums["mismatch_abs"] += float(((rollout - old).abs() * mask).sum()) / max(num_tokens, 1)
    return old
