"""Per-token estimators of KL(pi || ref) from samples of pi (J. Schulman, "Approximating KL
divergence", 2020, http://joschu.net/blog/kl-approx.html).

With ``d = logp - ref_logp`` at the sampled token (so that E_pi[d] = KL(pi || ref)):

* ``k1 = d``                        unbiased, high variance, can be negative
* ``k2 = d**2 / 2``                 biased, low variance, >= 0
* ``k3 = exp(-d) - 1 + d``          unbiased, low variance, >= 0
* ``k3_clamped``: k3 with ``-d`` clamped to [-20, 20] before the exp and the result clamped to
  at most 10, so that one token whose logprobs moved far cannot produce an inf or dominate a
  step (the "low-variance KL" used by several RL frameworks). Departure: biased where it clamps.

k3 is computed as ``expm1(-d) + d`` and clamped at 0 from below: ``exp(-d) - 1 + d`` in floating
point loses every digit for small ``d`` (e.g. -6e-8 at d = 1e-4 in fp32, where k3 is 5e-9) and can go
negative when the two logprob passes differ only by rounding.

Shapes: ``logprobs``, ``ref_logprobs``, ``mask`` [N, T] -> [N, T], zero where ``mask`` is zero.
As a loss term the chosen estimator is differentiated directly w.r.t. ``logprobs``; note that
the k1 loss term has zero expected gradient (its gradient is the score function), so k1 is only
meaningful as a reward penalty.
"""

from __future__ import annotations

import torch

K3_LOG_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    d = (logprobs - ref_logprobs) * mask
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d**2
    elif estimator == "k3":
        kl = (torch.expm1(-d) + d).clamp_min(0)
    elif estimator == "k3_clamped":
        neg = (-d).clamp(-K3_LOG_CLAMP, K3_LOG_CLAMP)
        kl = (torch.expm1(neg) - neg).clamp(0, K3_VALUE_CLAMP)
    else:
        raise ValueError(f"unknown KL estimator '{estimator}'")
    return kl * mask
