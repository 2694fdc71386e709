"""PPO-clip and SFT. Each returns a per-token loss [N, T]; aggregation is separate (aggregate.py).

PPO-clip (Schulman et al. 2017, arXiv:1707.06347), per token, with ratio = exp(logp - old_logp):

    pg_t = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))

* ``eps_high`` defaults to ``eps_low``; set ``eps_clip_high`` for DAPO's clip-higher
  (Yu et al. 2025, arXiv:2503.14476).
* Dual clip (Ye et al. 2020, arXiv:1912.09729), ``clip_c = c > 1``: for A < 0 the loss is
  further bounded, pg_t = min(pg_t, -c * A), so a huge ratio on a bad token cannot blow up.
* The log ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20] before the exp (as verl does): past
  e^88.7 the fp32 ratio is inf, and -A * inf is NaN where A = 0 (every token of an all-equal GRPO group), which
  made the whole step's loss NaN. A clamped token has no gradient; PPO-clip would give it none (A > 0) or a
  gradient of |A| * ratio >= |A| * 5e8 (A < 0) that swamps the step's every other token.
* Then the shared terms (regularizers.py): mismatch weights, KL loss term, entropy bonus.

Metrics: ``clip_frac`` (tokens where the clipped branch is active), ``dual_clip_frac``,
``approx_kl`` = mean (logp - old_logp)^2 / 2 (k2 to the old policy), ``kl_ref``, mismatch metrics.

SFT: loss_t = -logp_t on the response tokens (the advantages are ignored).
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.masked import masked_mean
from miles_core.algorithms.regularizers import apply_regularizers
from miles_core.types import LossInputs, LossOutput

LOG_RATIO_CLAMP = 20.0


def clip_range(cfg: AlgorithmConfig) -> tuple[float, float]:
    return cfg.eps_clip, cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """The importance ratio from its log, finite in fp32 (see the module docstring)."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def clipped_pg(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig, metrics: dict) -> torch.Tensor:
    eps_low, eps_high = clip_range(cfg)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        metrics["clip_frac"] = float(masked_mean((clipped > unclipped).float(), mask))
    if cfg.clip_c is not None:
        bound = -adv * cfg.clip_c
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
        metrics["dual_clip_frac"] = float(masked_mean(dual.float(), mask))
    return pg


def ppo_clip(inputs: LossInputs, cfg: AlgorithmConfig) -> LossOutput:
    mask = inputs.response_mask
    log_ratio = (inputs.logprobs - inputs.old_logprobs) * mask
    metrics: dict[str, float] = {"approx_kl": float(masked_mean(0.5 * log_ratio.detach() ** 2, mask))}
    pg = clipped_pg(clamped_exp(log_ratio), inputs.advantages, mask, cfg, metrics)
    return LossOutput(loss=apply_regularizers(pg, inputs, cfg, metrics), metrics=metrics)


def sft(inputs: LossInputs, cfg: AlgorithmConfig) -> LossOutput:
    loss = -inputs.logprobs
    return LossOutput(loss=loss, metrics={"nll": float(masked_mean(loss.detach(), inputs.response_mask))})
