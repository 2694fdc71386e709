"""Score samples with a reward function, sync or async; an async reward runs under a timeout (a sync one
runs to completion: a blocked call cannot be interrupted from inside the process).

An exception in reward code stops the run with one line naming the reward and the sample.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers

from miles_core.errors import MilesUserError
from miles_core.rewards.base import RewardFn
from miles_core.types import Sample


class RewardError(MilesUserError):
    pass


def is_reward_value(value: object) -> bool:
    """A finite real number: int, float, or numpy's scalars (np.float32 and np.int64 are not float and int
    subclasses, and a verifier computing with numpy returns them). Not a bool (nor numpy's), nor an int beyond
    float's range."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int (or Fraction) too large for a float: not a reward the trainer can hold
        return False


def _check(value: object, name: str, sample: Sample) -> float:
    if not is_reward_value(value):
        raise RewardError(f"reward '{name}' returned {value!r} for sample {sample.index}; it must return a finite number")
    return float(value)


def _raised(name: str, exc: Exception, sample: Sample) -> RewardError:
    return RewardError(f"reward '{name}' raised {type(exc).__name__}: {exc} (sample {sample.index}, prompt {sample.prompt!r})")


def _call(fn: RewardFn, name: str, sample: Sample) -> object:
    """``fn(sample)``, called outside any event loop: a sync reward is plain code and may run one of its own
    (``asyncio.run``, itself or inside a client library)."""
    try:
        return fn(sample)
    except MilesUserError:
        raise
    except Exception as exc:
        raise _raised(name, exc, sample) from None


async def _settle(value: object, name: str, sample: Sample, timeout: float) -> object:
    """An async reward's value, awaited under ``reward.timeout_s``; anything else as it is."""
    if not inspect.isawaitable(value):
        return value
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            return await value
    except MilesUserError:
        raise
    except Exception as exc:
        if scope.expired():  # reward.timeout_s ran out; a TimeoutError of the reward's own code is its error
            raise RewardError(f"reward '{name}' timed out after {timeout}s on sample {sample.index}") from None
        raise _raised(name, exc, sample) from None


async def _settle_all(values: list, name: str, samples: list[Sample], timeout: float) -> list:
    return list(await asyncio.gather(*(_settle(v, name, s, timeout) for v, s in zip(values, samples))))


def score_samples(fn: RewardFn, name: str, samples: list[Sample], timeout: float) -> list[float]:
    """Set ``sample.reward`` on every sample and return the rewards in order. Every call is made first; the
    awaitables they return (async rewards) are then awaited together."""
    values: list = []
    try:
        for s in samples:
            values.append(_call(fn, name, s))
    except BaseException:
        for v in values:  # the coroutines made so far are never awaited
            if inspect.iscoroutine(v):
                v.close()
        raise
    if any(inspect.isawaitable(v) for v in values):
        values = asyncio.run(_settle_all(values, name, samples, timeout))
    rewards = [_check(v, name, s) for v, s in zip(values, samples)]
    for s, r in zip(samples, rewards):
        s.reward = r
    return rewards
