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
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from miles_core.errors import ConfigError, MilesUserError
from miles_core.rollout.sglang.http import EngineDown
from miles_core.rollout.sglang.launch import free_port
from miles_core.sync.buckets import buckets, dtype_name
from miles_core.sync.process_group import broadcast, make_group


def _check(url: str, path: str, res) -> None:
    if isinstance(res, dict) and res.get("success") is False:
        raise MilesUserError(f"{url}{path}: {res.get('message', res)}")


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

    def _connect(self, rollout, urls: list[str], dist_backend: str) -> None:
        port = free_port(self.master_address)
        self._name = f"miles-weights-{uuid.uuid4().hex[:8]}"
        world = 1 + self.ranks_per_engine * len(urls)
        bodies = [{"master_address": self.master_address, "master_port": port, "rank_offset": 1 + self.ranks_per_engine * i,
                   "world_size": world, "group_name": self._name, "backend": dist_backend} for i in range(len(urls))]
        with ThreadPoolExecutor(len(urls)) as pool:
            futs = [pool.submit(rollout.post, u, "/init_weights_update_group", b) for u, b in zip(urls, bodies)]
            self._group, self._store = make_group(dist_backend, self.master_address, port, 0, world, self._name)
            for u, f in zip(urls, futs):
                _check(u, "/init_weights_update_group", f.result())
        self._members, self._dist_backend = list(urls), dist_backend

    def push(self, weights: Mapping[str, torch.Tensor], version: int, backend) -> None:
        if not hasattr(backend, "engine_urls"):
            raise ConfigError(f"sync.transport=distributed needs an HTTP rollout backend (rollout.backend=sglang), not {type(backend).__name__}")
        first = next(iter(weights.values()))
        dist_backend = self.backend if self.backend != "auto" else ("nccl" if first.is_cuda else "gloo")
        device = first.device if dist_backend == "nccl" else torch.device("cpu")
        with backend.weights_lock:
            for attempt in range(3):
                try:
                    self._push_once(weights, version, backend, dist_backend, device)
                    break
                except (EngineDown, RuntimeError, MilesUserError):
                    # an engine died during the push: the group is broken; once every engine is
                    # serving again, build a new group and send the whole version again
                    if attempt == 2 or not hasattr(backend, "wait_all_up") or backend.monitor is None:
                        raise
                    self._members = None
                    backend.wait_all_up()
            backend.remember(version, state=weights)

    def _push_once(self, weights, version, backend, dist_backend, device) -> None:
        urls = backend.engine_urls()
        if urls != self._members or dist_backend != self._dist_backend:
            self._connect(backend, urls, dist_backend)
        parts = buckets(weights, self.bucket_bytes)
        with ThreadPoolExecutor(len(urls)) as pool:
            for i, part in enumerate(parts):
                body = {"names": [n for n, _ in part], "dtypes": [dtype_name(t) for _, t in part],
                        "shapes": [list(t.shape) for _, t in part], "group_name": self._name,
                        "weight_version": str(version), "flush_cache": i == len(parts) - 1}
                futs = [pool.submit(backend.post, u, "/update_weights_from_distributed", body) for u in urls]
                for _, t in part:
                    broadcast(self._group, t.detach().to(device).contiguous())
                for u, f in zip(urls, futs):
                    _check(u, "/update_weights_from_distributed", f.result())
