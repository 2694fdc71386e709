"""Where each step's samples come from: the rollout schedules and the saved-rollout source.

* ``sync``: step k generates with the weights of step k-1 (on-policy), then trains.
* ``one_step_off``: as soon as step k's samples are handed to the trainer, step k+1's generation
  starts in a background thread with the weights the engine holds (``v_{k-1}``); training of step
  k runs meanwhile. The weight sync after step k waits for that generation to finish (the engine
  takes new weights between batches), then pushes ``v_k``. Every sample is exactly one version
  behind the trainer (``Sample.weight_version`` says which), so the off-policy corrections
  (TIS, the mismatch metrics) see the real gap. Rollout and training overlap: with equal times a
  step takes about ``max(rollout, train)`` instead of their sum.
* ``async``: continuous rollout with partial rollouts (:mod:`miles_core.orchestration.async_rollout`).
* ``LoadedRollouts``: train-only debug mode, steps read from ``--load-rollouts DIR``.

Every source returns ``(samples, metrics)`` with ``time_generate``: the seconds the generation and
the scoring took (the loop's ``time_rollout`` is how long it waited for the samples), and, where an
engine generated them, ``rollout_tok_s``: the tokens it generated (those of groups dynamic sampling
dropped included) over the seconds it spent generating, not scoring; saved rollouts have none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from miles_core.orchestration.collect import collect
from miles_core.orchestration.rollout_io import load_rollouts
from miles_core.orchestration.seeds import INDEX_KEY
from miles_core.rollout.base import SamplingParams
from miles_core.types import Prompt, Sample

NextPrompts = Callable[[int, int], list[Prompt]]  # (how many, for which step) -> prompts
Result = tuple[list[Sample], dict[str, float]]


def _generate(c, backend, next_prompts: NextPrompts, params: SamplingParams, step: int, stopped=lambda: False) -> Result:
    t0 = time.perf_counter()
    samples, metrics = collect(c, backend, lambda n: next_prompts(n, step), params, stopped)
    return samples, {**metrics, "time_generate": time.perf_counter() - t0}


class SyncSchedule:
    def __init__(self, c, backend, next_prompts: NextPrompts, params: SamplingParams, last_step: int) -> None:
        self.c, self.backend, self.next_prompts, self.params, self.last_step = c, backend, next_prompts, params, last_step

    def get(self, step: int) -> Result:
        return _generate(self.c, self.backend, self.next_prompts, self.params, step)

    def before_sync(self) -> None:
        """Called before a weight push: the engine must be idle."""

    def after_sync(self, version: int) -> None:
        """Called after the push (and the eval that may follow it): the engine holds ``version``."""

    def pending_prompts(self) -> list[int]:
        """The stream indices (``INDEX_KEY``) of the prompts drawn for samples not yet returned by ``get``: a checkpoint
        records them, and a resumed run draws them first."""
        return []

    def close(self) -> None:
        pass


class OneStepOffSchedule(SyncSchedule):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        draw, self._drawn = self.next_prompts, {}  # step -> stream indices of the prompts drawn for it

        def counted(n: int, step: int) -> list[Prompt]:
            prompts = draw(n, step)
            self._drawn.setdefault(step, []).extend(p.metadata[INDEX_KEY] for p in prompts)
            return prompts

        self.next_prompts = counted
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-rollout")
        self._ahead: tuple[int, Future] | None = None
        self._closing = threading.Event()  # set by close: the generation ahead stops without scoring its samples

    def get(self, step: int) -> Result:
        if self._ahead is not None and self._ahead[0] == step:
            result = self._ahead[1].result()
        else:
            result = super().get(step)
        self._ahead = None
        self._drawn = {k: v for k, v in self._drawn.items() if k > step}
        if step < self.last_step:
            self._ahead = (step + 1, self._pool.submit(_generate, self.c, self.backend, self.next_prompts, self.params, step + 1,
                                                       self._closing.is_set))
        return result

    def before_sync(self) -> None:
        if self._ahead is not None:
            self._ahead[1].exception()  # wait; an error surfaces from get()

    def pending_prompts(self) -> list[int]:
        """The prompts of the generation running ahead (once it ends: dynamic sampling may draw more), not trained yet."""
        if self._ahead is None:
            return []
        step, fut = self._ahead
        fut.exception()
        return list(self._drawn.get(step, []))

    def close(self) -> None:
        """A generation still running ahead means the run stops early (an error, Ctrl-C): nobody trains on its
        samples, so it is aborted rather than waited for (minutes on a real rollout, past a scheduler's grace period),
        and its samples are not scored (a slow verifier takes seconds a sample)."""
        self._closing.set()
        abort = getattr(self.backend, "abort_all", None)
        if self._ahead is not None and abort is not None:
            fut = self._ahead[1]
            while not fut.done():  # again until it ends: an abort before its generate started is not seen by it
                abort()
                wait([fut], timeout=0.05)
        self._pool.shutdown(wait=True, cancel_futures=True)


class LoadedRollouts:
    def __init__(self, root: str, vocab_size: int | None = None) -> None:
        self.root, self.vocab_size = root, vocab_size

    def get(self, step: int) -> Result:
        return load_rollouts(self.root, step, self.vocab_size), {"time_generate": 0.0}

    def before_sync(self) -> None:
        pass

    def after_sync(self, version: int) -> None:
        pass

    def pending_prompts(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


def make_source(c, backend, next_prompts: NextPrompts, params: SamplingParams, last_step: int, first_step: int = 1):
    run, orch = c.ctx.config.run, c.ctx.config.orchestration
    if run.load_rollouts:
        return LoadedRollouts(run.load_rollouts, c.model.config.vocab_size)
    if orch.schedule == "async":
        from miles_core.orchestration.async_rollout import AsyncSchedule

        return AsyncSchedule(c, backend, next_prompts, params, last_step, first_step)
    cls = OneStepOffSchedule if orch.schedule == "one_step_off" else SyncSchedule
    return cls(c, backend, next_prompts, params, last_step)
