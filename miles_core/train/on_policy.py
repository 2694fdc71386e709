"""Old-policy logprobs taken from the training forward itself (``train.old_logprobs=auto``).

With one optimizer step per rollout batch, the weights that sampled (after the last weight sync) are
the weights of every micro-batch of the step, so ``old_logprobs = logprobs.detach()``: the ratio
``exp(logprobs - old_logprobs)`` is 1 in value and has the policy gradient's derivative, exactly as
with a separate no-grad pass, which this saves. The engine-vs-trainer mismatch that the loop reports
from the separate pass is accumulated here instead.
"""

from __future__ import annotations

import torch

from miles_core.algorithms.masked import masked_mean
from miles_core.algorithms.mismatch import mismatch_metrics
from miles_core.types import TrainBatch


def on_policy_old(logprobs: torch.Tensor, mb: TrainBatch, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's old logprobs [n, T] and its metrics: ``mb.old_logprobs`` when given (no metrics), else
    ``logprobs`` detached, with that micro-batch's mismatch_kl / mismatch_k1 / mismatch_abs (means over its response
    tokens; none without ``mb.rollout_logprobs``). The trainer weighs them by the micro-batch's tokens as the loss's
    own metrics, under which a loss that reports mismatch_kl / mismatch_k1 too (apply_regularizers) counts once."""
    if mb.old_logprobs is not None:
        return mb.old_logprobs.to(logprobs.device), {}
    old = logprobs.detach()
    if mb.rollout_logprobs is None:
        return old, {}
    with torch.no_grad():
        rollout = mb.rollout_logprobs.to(old.device)
        metrics = mismatch_metrics(old, rollout, mask)
        metrics["mismatch_abs"] = float(masked_mean((rollout - old).abs(), mask))
    return old, metrics
