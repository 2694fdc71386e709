"""Crash recovery for launched rollout engines: a monitor thread that notices a dead engine,
has it restarted, and records how long it took (death detected -> engine serving again).

The monitor knows nothing about HTTP or weights: ``alive(i)`` says whether engine ``i`` still
runs, ``restart(i)`` brings it back (relaunch, wait for /health, load the current weights) and
returns when it serves. The owner (the ``sglang`` rollout backend) resubmits the requests that
were in flight on it. A failed restart is kept and re-raised to whoever waits on that engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Recovery:
    engine: int
    detected_at: float  # time.monotonic() when the death was noticed
    seconds: float  # detected -> serving again


class EngineMonitor:
    def __init__(self, num_engines: int, alive: Callable[[int], bool], restart: Callable[[int], None],
                 interval_s: float = 0.2, max_restarts: int = 100) -> None:
        self.num_engines = num_engines
        self._alive, self._restart = alive, restart
        self.interval_s, self.max_restarts = interval_s, max_restarts
        self.recoveries: list[Recovery] = []
        self.failures: dict[int, BaseException] = {}
        self._taken = 0  # recoveries already reported by pop_new()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="miles-engine-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def check_once(self) -> None:
        for i in range(self.num_engines):
            if self._stop.is_set() or i in self.failures or self._alive(i):
                continue
            t0 = time.monotonic()
            try:
                if len(self.recoveries) >= self.max_restarts:
                    raise RuntimeError(f"engine {i} died, and the run's engines were already restarted {len(self.recoveries)} "
                                       f"times (rollout.sglang.max_restarts={self.max_restarts}, counted over all engines)")
                self._restart(i)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting callers
                with self._lock:
                    self.failures[i] = exc
                continue
            with self._lock:
                self.recoveries.append(Recovery(i, t0, time.monotonic() - t0))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check_once()

    def pop_new(self) -> list[Recovery]:
        """The recoveries since the last call (one step's)."""
        with self._lock:
            new = self.recoveries[self._taken:]
            self._taken = len(self.recoveries)
        return new
