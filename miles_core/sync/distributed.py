"""``distributed`` weight transport: torch.distributed broadcast from the trainer (rank 0) to the
engines, in buckets, over SGLang's protocol.

1. Once per set of engines: ``POST /init_weights_update_group`` to each engine with
   ``master_address``, ``master_port``, ``rank_offset`` (1 + the ranks before it), ``world_size``
   (1 + all engine ranks), ``group_name``, ``backend``; the trainer joins as rank 0 meanwhile.
2. Per bucket (``sync.bucket_mb``): ``POST /update_weights_from_distributed`` with ``names``,
   ``dtypes``, ``shapes``, ``group_name``, ``weight_version``, ``flush_cache`` to every engine (the
   answer comes once the engine has received and loaded the bucket), while the trainer broadcasts
   the bucket's tensors in that order.

Gloo for CPU tensors, NCCL on GPU (``sync.dist_backend: auto`` picks by the trainer's tensors).
When an engine was restarted (its URL changed) the group is built anew before the next push.
Every wait of the trainer (the group's rendezvous, a broadcast, an engine's answer) also watches
the engines: if one dies meanwhile the push stops at once (rather than at the group's timeout),
leaves the broken group behind, and is retried on a new group once the engines serve again.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from miles_core.errors import ConfigError, MilesUserError
from miles_core.rollout.sglang.http import EngineDown
from miles_core.sync.buckets import buckets, dtype_name
from miles_core.sync.process_group import host_store, make_group


def _check(url: str, path: str, res) -> None:
    if isinstance(res, dict) and res.get("success") is False:
        raise MilesUserError(f"{url}{path}: {res.get('message', res)}")


def _watch(dead: Callable[[], str | None], done: Callable[[], bool], what: str) -> None:
    """Wait until ``done()``; raise EngineDown as soon as ``dead()`` names a dead engine."""
    pause = 0.0005
    while not done():
        url = dead()
        if url is not None:
            raise EngineDown(url, f"died during {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class DistributedTransport:
    def __init__(self, bucket_bytes: int, backend: str = "auto", master_address: str = "127.0.0.1", ranks_per_engine: int = 1) -> None:
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.master_address = master_address
        self.ranks_per_engine = ranks_per_engine
        self._members: list[str] | None = None
        self._group = None
        self._store = None
        self._name = ""
        self._dist_backend = ""
        self._broken: list = []  # groups left by a dead engine: kept, so no destructor waits on their pending work

    def _posts(self, pool, rollout, urls, path, bodies, dead) -> None:
        futs = [pool.submit(rollout.post, u, path, b) for u, b in zip(urls, bodies)]
        _watch(dead, lambda: all(f.done() for f in futs) or any(f.done() and f.exception() is not None for f in futs), path)
        for u, f in zip(urls, futs):
            _check(u, path, f.result())

    def _connect(self, pool, rollout, urls: list[str], dist_backend: str, dead) -> None:
        if self._group is not None:
            self._broken.append((self._group, self._store))
            self._group = self._store = None
        self._members = None
        # SGLang joins one rank per TP rank (server_args tp_size); `miles serve` drops tp_size and joins as one
        ranks = 1 if getattr(rollout, "kind", "") == "miles" else self.ranks_per_engine
        world = 1 + ranks * len(urls)
        store = host_store(self.master_address, world)
        port = store.port
        name = f"miles-weights-{uuid.uuid4().hex[:8]}"
        bodies = [{"master_address": self.master_address, "master_port": port, "rank_offset": 1 + ranks * i,
                   "world_size": world, "group_name": name, "backend": dist_backend} for i in range(len(urls))]
        joined: dict = {}

        def join() -> None:  # blocks until every rank joined; left behind if an engine dies
            try:
                joined["group"] = make_group(dist_backend, self.master_address, port, 0, world, name, store=store)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, or dropped with the broken group
                joined["error"] = exc

        thread = threading.Thread(target=join, name="miles-weight-group", daemon=True)
        thread.start()
        self._broken.append(joined)  # if this rendezvous is abandoned, its group stays referenced
        self._posts(pool, rollout, urls, "/init_weights_update_group", bodies, dead)
        _watch(dead, lambda: not thread.is_alive(), "the weight group's rendezvous")
        if "error" in joined:
            raise joined["error"]
        (self._group, self._store), self._name = joined["group"], name
        self._members, self._dist_backend = list(urls), dist_backend

    def push(self, weights: Mapping[str, torch.Tensor], version: int, backend) -> None:
        if not hasattr(backend, "engine_urls"):
            raise ConfigError(f"sync.transport=distributed needs an HTTP rollout backend (rollout.backend=sglang), not {type(backend).__name__}")
        first = next(iter(weights.values()))
        dist_backend = self.backend if self.backend != "auto" else ("nccl" if first.is_cuda else "gloo")
        device = first.device if dist_backend == "nccl" else torch.device("cpu")
        for attempt in range(3):
            try:
                with backend.weights_lock:  # a restart waits for the push, and the reverse
                    self._push_once(weights, version, backend, dist_backend, device)
                    backend.remember(version, state=weights)
                return
            except (EngineDown, RuntimeError, MilesUserError):
                # an engine died during the push: the group is broken. Outside the lock (the restart
                # needs it), wait until every engine serves again, then build a new group and send
                # the whole version again (a restarted engine got the previous one meanwhile)
                if attempt == 2 or getattr(backend, "monitor", None) is None:
                    raise
                self._members = None
                backend.wait_all_up()

    def _push_once(self, weights, version, backend, dist_backend, device) -> None:
        urls = backend.engine_urls()
        recovering = getattr(backend, "recovering", None)

        def dead() -> str | None:
            return next((u for u in urls if recovering(u)), None) if recovering is not None else None

        pool = ThreadPoolExecutor(len(urls))
        try:
            if urls != self._members or dist_backend != self._dist_backend:
                self._connect(pool, backend, urls, dist_backend, dead)
            parts = buckets(weights, self.bucket_bytes)
            for i, part in enumerate(parts):
                body = {"names": [n for n, _ in part], "dtypes": [dtype_name(t) for _, t in part],
                        "shapes": [list(t.shape) for _, t in part], "group_name": self._name,
                        "weight_version": str(version), "flush_cache": i == len(parts) - 1}
                futs = [pool.submit(backend.post, u, "/update_weights_from_distributed", body) for u in urls]
                for _, t in part:
                    work = self._group.broadcast(t.detach().to(device).contiguous(), 0)
                    _watch(dead, work.is_completed, "a weight broadcast")
                    work.wait()
                _watch(dead, lambda: all(f.done() for f in futs), "/update_weights_from_distributed")
                for u, f in zip(urls, futs):
                    _check(u, "/update_weights_from_distributed", f.result())
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a live engine stuck in a broken group answers later
