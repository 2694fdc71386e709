"""Policy losses. Each returns a per-token loss [N, T]; aggregation is separate (aggregate.py).

PPO-clip (Schulman et al. 2017, arXiv:1707.06347), per token, with ratio = exp(logp - old_logp):

    loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

``eps_high`` defaults to ``eps_low`` (set ``eps_clip_high`` for DAPO's clip-higher,
arXiv:2503.14476). With ``kl_coef > 0`` and reference logprobs, the low-variance k3 estimator
of KL(pi || ref) is added: kl_coef * (exp(ref - logp) - (ref - logp) - 1).

SFT: loss_t = -logp_t on the response tokens (the advantages are ignored).
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.types import LossInputs, LossOutput


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def ppo_clip(inputs: LossInputs, cfg: AlgorithmConfig) -> LossOutput:
    mask = inputs.response_mask
    log_ratio = (inputs.logprobs - inputs.old_logprobs) * mask
    ratio = log_ratio.exp()
    eps_low = cfg.eps_clip
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    adv = inputs.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        metrics = {
            "clip_frac": _masked_mean((clipped < unclipped).float(), mask),
            "approx_kl": _masked_mean(0.5 * log_ratio**2, mask),
        }
    if cfg.kl_coef > 0 and inputs.ref_logprobs is not None:
        d = (inputs.ref_logprobs - inputs.logprobs) * mask
        kl = d.exp() - d - 1
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = _masked_mean(kl.detach(), mask)
    return LossOutput(loss=loss, metrics=metrics)


def sft(inputs: LossInputs, cfg: AlgorithmConfig) -> LossOutput:
    loss = -inputs.logprobs
    return LossOutput(loss=loss, metrics={"nll": _masked_mean(loss.detach(), inputs.response_mask)})
