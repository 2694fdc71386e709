"""Drive an :class:`EngineCore` from one background thread, for concurrent callers (the HTTP server).

Callers never touch the core: they post commands (``submit``, ``call``) that the engine thread runs
between steps, and read each request's outputs from its own queue. ``pause`` stops stepping (the
running requests keep their KV and resume on ``resume``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.core import EngineCore
from miles_core.rollout.engine_core.request import Request, RequestOutput


class ThreadedEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.Queue[tuple[Callable[[EngineCore], Any], Future]] = queue.Queue()
        self._sinks: dict[str, queue.Queue[RequestOutput]] = {}
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="miles-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def call(self, fn: Callable[[EngineCore], Any], timeout: float | None = None) -> Any:
        """Run ``fn(core)`` on the engine thread; return its result or raise its exception."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut.result(timeout)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, n: int = 1) -> tuple[list[Request], queue.Queue]:
        """Queue ``n`` samples; their outputs arrive on the returned queue (one queue for the group)."""
        sink: queue.Queue[RequestOutput] = queue.Queue()

        def add(core: EngineCore) -> list[Request]:
            reqs = core.add_request(prompt_ids, params, request_id, n)
            for r in reqs:
                self._sinks[r.request_id] = sink
            return reqs

        return self.call(add), sink

    def abort(self, request_id: str) -> bool:
        return self.call(lambda core: core.abort(request_id))

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    fn, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    fut.set_result(fn(self.core))
                except BaseException as exc:  # handed to the caller
                    fut.set_exception(exc)
                self._dispatch(self.core._pending)
                self.core._pending = []
            if self._paused.is_set() or not self.core.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self._dispatch(self.core.step())
            except BaseException as exc:  # a failing step ends every request instead of hanging them
                for rid in list(self.core.requests):
                    self.core.abort(rid)
                outs, self.core._pending = self.core._pending, []
                for o in outs:
                    o.request.matched_stop = f"engine error: {exc}"
                self._dispatch(outs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                sink.put(out)
                if out.finished:
                    del self._sinks[out.request_id]
