"""GSPO: group sequence policy optimization (Zheng et al. 2025, arXiv:2507.18071).

The importance ratio is per sequence, the length-normalized likelihood ratio

    s_i = exp( (1 / |y_i|) * sum_t (logp_it - old_logp_it) )

* ``gspo``: pg_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)); A_i is the
  sequence's advantage (the mean of its token advantages, which is the GRPO advantage itself).
  The per-token loss is pg_i on every token of sequence i, so ``loss_agg=seq_mean_token_mean``
  gives the paper's (1/G) sum_i pg_i; ``token_mean`` weighs sequences by length (a departure).
  ``clip_frac`` / ``dual_clip_frac`` are fractions of response tokens (those of clipped sequences).
* ``gspo_token``: s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] (same value as s_i, but the gradient of
  token t flows through its own logprob only), with per-token advantages A_it:
  pg_it = max(-A_it s_it, -A_it clip(s_it, ...)). With A_it = A_i it equals ``gspo``'s gradient.

Dual clip, the log-ratio clamp to [-20, 20], mismatch weights, KL and entropy terms apply as in
ppo_clip. The paper uses much tighter clip ranges than PPO (3e-4 / 4e-4); set
``eps_clip``/``eps_clip_high`` accordingly.
Shapes: logprobs, old_logprobs, advantages, response_mask [N, T] -> loss [N, T].
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.losses import clamped_exp, clipped_pg
from miles_core.algorithms.masked import masked_mean, seq_mean
from miles_core.algorithms.regularizers import apply_regularizers
from miles_core.types import LossInputs, LossOutput


def _seq_log_ratio(inputs: LossInputs) -> torch.Tensor:
    return seq_mean(inputs.logprobs - inputs.old_logprobs, inputs.response_mask)  # [N]


def gspo(inputs: LossInputs, cfg: AlgorithmConfig) -> LossOutput:
    mask = inputs.response_mask
    log_s = _seq_log_ratio(inputs)
    metrics: dict[str, float] = {"approx_kl": float(masked_mean(0.5 * log_s.detach()[:, None] ** 2, mask))}
    adv = seq_mean(inputs.advantages, mask)
    # on every token of its sequence, so that the clip metrics count tokens as ppo_clip's do: the trainer sums
    # them over micro-batches weighted by tokens (a fraction of sequences depended on the split)
    ratio, adv = clamped_exp(log_s)[:, None].expand_as(mask), adv[:, None].expand_as(mask)
    pg = clipped_pg(ratio, adv, mask, cfg, metrics) * mask
    return LossOutput(loss=apply_regularizers(pg, inputs, cfg, metrics), metrics=metrics)


def gspo_token(inputs: LossInputs, cfg: AlgorithmConfig) -> LossOutput:
    mask = inputs.response_mask
    log_s = _seq_log_ratio(inputs).detach()
    metrics: dict[str, float] = {"approx_kl": float(masked_mean(0.5 * log_s[:, None] ** 2, mask))}
    log_ratio = log_s[:, None] + inputs.logprobs - inputs.logprobs.detach()
    pg = clipped_pg(clamped_exp(log_ratio), inputs.advantages, mask, cfg, metrics) * mask
    return LossOutput(loss=apply_regularizers(pg, inputs, cfg, metrics), metrics=metrics)
