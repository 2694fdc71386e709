"""Rollout/train mismatch: importance weights between the engine that sampled and the trainer.

The rollout engine (e.g. SGLang in bf16) and the trainer compute slightly different
probabilities for the same tokens, so the samples are off-policy for the trainer's "old" policy.
With ``w_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logprobs - rollout_logprobs)``:

* token level: ``w_t`` per token.
* sequence level: ``w = exp(sum_t log w_t)`` (the product of the ratios), broadcast to the
  sequence's tokens; the log is clamped to [-20, 20] before the exp.
* ``tis`` (truncated IS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl): ``min(w, cap)``.
* ``mis`` (masked IS; Liu et al. 2025, "When Speed Kills Stability",
  https://yingru.notion.site/When-Speed-Kills-Stability): ``w`` where floor <= w <= cap, else 0,
  so tokens (or whole sequences) that are too far off-policy are dropped from the gradient.

The weights are constants (no grad) that multiply the per-token policy loss.
Metrics: ``mismatch_kl`` = mean k3 estimate of KL(pi_rollout || pi_old) over the tokens,
``mismatch_k1`` = mean(rollout - old), ``mismatch_weight_mean``, and the fraction of tokens whose
weight was truncated (TIS) or masked (MIS).
Shapes: old_logprobs, rollout_logprobs, mask [N, T] -> weights [N, T].
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.algorithms.masked import masked_mean

LOG_CLAMP = 20.0


def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    # in float64 with expm1: exp(x) - 1 - x in fp32 loses every digit at |x| ~ 1e-4 (0.0 where k3 is 5e-9), the size
    # of a bf16 engine's mismatch, and expm1(x) - x in fp32 keeps only three
    log_w = ((old_logprobs - rollout_logprobs) * mask).double()
    k3 = (torch.expm1(log_w) - log_w).clamp_min(0)
    return {"mismatch_kl": float(masked_mean(k3, mask)), "mismatch_k1": float(masked_mean(-log_w, mask))}


def mismatch_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(weights [N, T] or None when the correction is off, metrics)."""
    with torch.no_grad():
        metrics = mismatch_metrics(old_logprobs, rollout_logprobs, mask)
        if cfg.mismatch_correction == "none":
            return None, metrics
        log_w = (old_logprobs - rollout_logprobs) * mask
        if cfg.mismatch_level == "sequence":
            log_w = log_w.sum(-1, keepdim=True).expand_as(mask)
        w = torch.exp(log_w.clamp(-LOG_CLAMP, LOG_CLAMP))
        if cfg.mismatch_correction == "tis":
            changed = w > cfg.mismatch_cap
            w = w.clamp(max=cfg.mismatch_cap)
            metrics["mismatch_truncated_frac"] = float(masked_mean(changed.float(), mask))
        else:
            keep = (w >= cfg.mismatch_floor) & (w <= cfg.mismatch_cap)
            w = w * keep
            metrics["mismatch_masked_frac"] = float(masked_mean((~keep).float(), mask))
        w = w * mask
        metrics["mismatch_weight_mean"] = float(masked_mean(w, mask))
        return w, metrics
