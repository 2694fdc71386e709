"""Generate and score one step's samples, with DAPO's overlong shaping and dynamic sampling.

Without dynamic sampling this is one ``generate`` call on ``rollout.batch_size`` prompts. With
it, groups whose rewards are all equal are dropped and more prompts are generated (asking for the
missing groups divided by the keep rate seen so far, so one extra round usually fills the batch)
until ``rollout.batch_size`` groups are kept or ``algorithm.dynamic_sampling_max_rounds`` extra
rounds have run. Kept samples get fresh consecutive group ids and indices.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from miles_core.algorithms.dapo import informative_groups, overlong_penalty
from miles_core.rewards.runner import score_samples
from miles_core.rollout.base import SamplingParams
from miles_core.types import Prompt, Sample


def _score(c, samples: list[Sample]) -> list[float]:
    cfg = c.ctx.config
    rewards = score_samples(c.reward_fn, c.reward_name, samples, cfg.reward.timeout_s)
    a = cfg.algorithm
    if a.overlong_buffer > 0:
        for s in samples:
            s.reward += overlong_penalty(len(s.response_ids), cfg.rollout.max_response_len, a.overlong_buffer, a.overlong_penalty)
        rewards = [s.reward for s in samples]
    return rewards


def collect(c, backend, next_prompts: Callable[[int], list[Prompt]], params: SamplingParams,
            stopped: Callable[[], bool] = lambda: False) -> tuple[list[Sample], dict[str, float]]:
    """(samples with ``reward`` set, metrics). Samples of one group stay contiguous.

    ``stopped()`` true after a ``generate`` (one_step_off's generation ahead, aborted as the run stops) ends it there:
    nobody trains on those samples, so they are returned unscored rather than waiting for the reward on each."""
    cfg = c.ctx.config
    want, n = cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt
    engine = [0, 0.0]  # tokens generated, seconds in generate: the throughput is the engine's, not the rewards'

    def generate(prompts: list[Prompt]) -> list[Sample]:
        t0 = time.perf_counter()
        out = backend.generate(prompts, params, n=n)
        engine[1] += time.perf_counter() - t0
        engine[0] += sum(len(s.response_ids) for s in out)  # dropped groups' too: the engine generated them
        return out

    def throughput() -> dict[str, float]:
        return {"rollout_tok_s": engine[0] / engine[1]} if engine[1] > 0 else {}

    samples = generate(next_prompts(want))
    if stopped():
        return samples, {}
    _score(c, samples)
    if not cfg.algorithm.dynamic_sampling:
        return samples, {**throughput(), **_backend_metrics(backend)}
    kept: list[list[Sample]] = []
    generated = rounds = 0
    while True:
        generated += len(samples) // n
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        good = informative_groups([s.reward for s in samples], [s.group_id for s in samples])
        kept.extend(groups[g] for g in sorted(good))
        if len(kept) >= want or rounds >= cfg.algorithm.dynamic_sampling_max_rounds:
            break
        rounds += 1
        rate = max(len(kept) / generated, 1.0 / 8)
        ask = min(math.ceil((want - len(kept)) / rate), 8 * want)
        samples = generate(next_prompts(ask))
        if stopped():
            return samples, {}
        _score(c, samples)
    out = []
    for gi, group in enumerate(kept[:want]):
        for s in group:
            s.group_id, s.index = gi, len(out)
            out.append(s)
    metrics = {
        "dynamic_sampling_rounds": float(rounds),
        "dynamic_sampling_kept_groups": float(min(len(kept), want)),
        "dynamic_sampling_generated_groups": float(generated),
        **throughput(),
        **_backend_metrics(backend),
    }
    return out, metrics


def _backend_metrics(backend) -> dict[str, float]:
    """What the backend reports about the step (the sglang backend: engine_restarts, recovery_s)."""
    pop = getattr(backend, "pop_metrics", None)
    return pop() if pop is not None else {}
