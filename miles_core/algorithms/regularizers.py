"""Terms every policy loss shares: mismatch weights, the KL-to-reference loss term, the entropy bonus.

    loss_t = w_t * pg_t + kl_coef * kl_t - entropy_coef * H_t

* ``w_t``: rollout/train mismatch weight (mismatch.py); 1 when the correction is off. Without the engine's
  logprobs (``rollout_logprobs`` None) there is no weight to take: a correction is refused, not skipped.
* ``kl_t``: the ``kl_estimator`` of KL(pi || ref) at the current logprobs (kl.py), only with
  ``kl_mode=loss`` and ``kl_coef > 0`` (with ``kl_mode=reward`` it is in the advantages instead).
* ``H_t``: the entropy of the policy's next-token distribution at step t (from the trainer).
Shapes: every tensor [N, T].
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.kl import kl_estimate
from miles_core.algorithms.masked import masked_mean
from miles_core.algorithms.mismatch import mismatch_weights
from miles_core.errors import DataError
from miles_core.types import LossInputs


def apply_regularizers(pg: torch.Tensor, inputs: LossInputs, cfg: AlgorithmConfig, metrics: dict[str, float]) -> torch.Tensor:
    mask = inputs.response_mask
    loss = pg
    if inputs.rollout_logprobs is None and cfg.mismatch_correction != "none":
        raise DataError(f"algorithm.mismatch_correction={cfg.mismatch_correction} needs the rollout engine's per-token "
                        f"logprobs; this batch has none (LossInputs.rollout_logprobs is None)")
    if inputs.rollout_logprobs is not None:
        weights, m = mismatch_weights(inputs.old_logprobs, inputs.rollout_logprobs, mask, cfg)
        metrics.update(m)
        if weights is not None:
            loss = loss * weights
    if inputs.ref_logprobs is not None:
        kl = kl_estimate(inputs.logprobs, inputs.ref_logprobs, mask, cfg.kl_estimator_used)
        metrics["kl_ref"] = float(masked_mean(kl.detach(), mask))
        if cfg.kl_mode == "loss" and cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    if cfg.entropy_coef > 0 and inputs.entropy is not None:
        loss = loss - cfg.entropy_coef * inputs.entropy
    return loss
