"""Score samples with a reward function, sync or async; an async reward runs under a timeout (a sync one
runs to completion: a blocked call cannot be interrupted from inside the process).

Async rewards are awaited on an event loop in a thread of their own, which the caller waits for with a deadline of
its own: a coroutine that blocks that loop (``time.sleep`` or a blocking HTTP client inside ``async def``) cannot be
cancelled, and would otherwise hang the run; past ``reward.timeout_s`` + :data:`BLOCKED_GRACE_S` it is an error naming
the first unfinished sample (the blocked thread is left to end on its own; it is a daemon).

An exception in reward code stops the run with one line naming the reward and the sample.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading

from miles_core.errors import MilesUserError
from miles_core.rewards.base import RewardFn
from miles_core.types import Sample


BLOCKED_GRACE_S = 2.0  # past reward.timeout_s, before a blocked event loop is reported


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
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__  # `assert ok`, a cancellation: no message
    return RewardError(f"reward '{name}' raised {what} (sample {sample.index}, prompt {sample.prompt!r})")


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
    except asyncio.CancelledError as exc:  # a BaseException: not the timeout's (that one ends as TimeoutError)
        if asyncio.current_task().cancelling():  # gather cancelling this sample, another one having failed
            raise
        raise _raised(name, exc, sample) from None  # the reward's own code cancelled (a request, a task it awaited)
    except Exception as exc:
        if scope.expired():  # reward.timeout_s ran out; a TimeoutError of the reward's own code is its error
            raise RewardError(f"reward '{name}' timed out after {timeout}s on sample {sample.index}") from None
        raise _raised(name, exc, sample) from None


async def _settle_all(values: list, name: str, samples: list[Sample], timeout: float, done: list[bool]) -> list:
    async def one(i: int) -> object:
        out = await _settle(values[i], name, samples[i], timeout)
        done[i] = True
        return out

    return list(await asyncio.gather(*(one(i) for i in range(len(values)))))


def _await_all(values: list, name: str, samples: list[Sample], timeout: float) -> list:
    """Await the async rewards on a loop in a daemon thread; past the deadline, an error instead of a hang."""
    done = [not inspect.isawaitable(v) for v in values]
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["values"] = asyncio.run(_settle_all(values, name, samples, timeout, done))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=run, name=f"miles-reward-{name}", daemon=True)
    worker.start()
    worker.join(timeout + BLOCKED_GRACE_S)
    if worker.is_alive():
        first = samples[done.index(False)].index if False in done else "?"
        raise RewardError(f"reward '{name}' did not finish within reward.timeout_s={timeout}s: sample {first} blocks its "
                          "event loop, so it cannot be cancelled (a blocking call such as time.sleep or a synchronous HTTP "
                          "client inside `async def`; await an async one, or wrap it in asyncio.to_thread)")
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["values"]  # type: ignore[return-value]


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
        values = _await_all(values, name, samples, timeout)
    rewards = [_check(v, name, s) for v, s in zip(values, samples)]
    for s, r in zip(samples, rewards):
        s.reward = r
    return rewards
