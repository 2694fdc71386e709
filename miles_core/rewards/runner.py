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
    subclasses, and a verifier computing with numpy returns them). Not a bool (nor numpy's)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check(value: object, name: str, sample: Sample) -> float:
    if not is_reward_value(value):
        raise RewardError(f"reward '{name}' returned {value!r} for sample {sample.index}; it must return a finite number")
    return float(value)


async def _score_all(fn: RewardFn, name: str, samples: list[Sample], timeout: float) -> list[float]:
    async def one(sample: Sample) -> float:
        scope = asyncio.timeout(timeout)
        try:
            value = fn(sample)
            if inspect.isawaitable(value):
                async with scope:
                    value = await value
        except MilesUserError:
            raise
        except Exception as exc:
            if scope.expired():  # reward.timeout_s ran out; a TimeoutError of the reward's own code is its error
                raise RewardError(f"reward '{name}' timed out after {timeout}s on sample {sample.index}") from None
            raise RewardError(f"reward '{name}' raised {type(exc).__name__}: {exc} (sample {sample.index}, prompt {sample.prompt!r})") from None
        return _check(value, name, sample)

    return list(await asyncio.gather(*(one(s) for s in samples)))


def score_samples(fn: RewardFn, name: str, samples: list[Sample], timeout: float) -> list[float]:
    """Set ``sample.reward`` on every sample and return the rewards in order."""
    rewards = asyncio.run(_score_all(fn, name, samples, timeout))
    for s, r in zip(samples, rewards):
        s.reward = r
    return rewards
