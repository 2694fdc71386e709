"""DAPO's sample-level extras (Yu et al. 2025, arXiv:2503.14476).

* Dynamic sampling: a group whose rewards are all equal has zero group-relative advantage and
  contributes no gradient; such groups are dropped and the loop generates more prompts to keep
  the batch full (``dynamic_sampling``, at most ``dynamic_sampling_max_rounds`` extra rounds;
  when the rounds run out the step trains on the groups it has). ``informative_groups`` is the filter.
* Overlong reward shaping (soft overlong punishment), with L_max = rollout.max_response_len and
  L_cache = ``overlong_buffer``, added to the reward of a response of |y| tokens:

      0                                  if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
      -1                                 if |y| > L_max

  scaled by ``overlong_penalty``. Departure: the engine never emits more than L_max tokens, so
  the last case only applies to samples from another backend.
"""

from __future__ import annotations

from collections.abc import Sequence


def informative_groups(rewards: Sequence[float], group_ids: Sequence[int], tol: float = 1e-9) -> set[int]:
    """The group ids whose rewards are not all equal (a group of one sample is never informative)."""
    by_group: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        by_group.setdefault(g, []).append(r)
    return {g for g, rs in by_group.items() if max(rs) - min(rs) > tol}


def overlong_penalty(length: int, max_len: int, buffer: int, scale: float = 1.0) -> float:
    if buffer <= 0:
        return 0.0
    start = max_len - buffer
    if length <= start:
        return 0.0
    if length <= max_len:
        return scale * (start - length) / buffer
    return -scale
