"""The engine side of SGLang's distributed weight update, for `miles serve`.

``/init_weights_update_group`` joins the group (rank ``rank_offset`` of ``world_size``; the
trainer is rank 0 and hosts the store). ``/update_weights_from_distributed`` allocates
``names``/``dtypes``/``shapes``, receives each tensor by broadcast from rank 0 in that order,
then loads them on the engine thread (between engine steps) with ``weight_version``.
"""

from __future__ import annotations

import threading

import torch

from miles_core.serve.protocol import BadRequest
from miles_core.sync.process_group import broadcast, make_group


def _req(body: dict, key: str, kind):
    v = body.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise BadRequest(f"'{key}' is missing or not a {kind.__name__ if isinstance(kind, type) else kind}")
    return v


class DistributedReceiver:
    def __init__(self) -> None:
        self.groups: dict[str, tuple] = {}  # group_name -> (process group, store, backend)
        self._lock = threading.Lock()

    def init_group(self, body: dict) -> None:
        name = body.get("group_name") or "weight_update_group"
        backend = body.get("backend") or "gloo"
        try:
            pg, store = make_group(backend, _req(body, "master_address", str), _req(body, "master_port", int),
                                   _req(body, "rank_offset", int), _req(body, "world_size", int), name)
        except RuntimeError as exc:  # the store or the rendezvous failed: a 400 naming the cause
            raise BadRequest(f"init_weights_update_group: {exc}") from None
        with self._lock:
            self.groups[name] = (pg, store, backend)

    def receive(self, body: dict, device: torch.device) -> dict[str, torch.Tensor]:
        names, dtypes, shapes = _req(body, "names", list), _req(body, "dtypes", list), _req(body, "shapes", list)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("'names', 'dtypes' and 'shapes' must have the same length")
        name = body.get("group_name") or "weight_update_group"
        with self._lock:
            entry = self.groups.get(name)
        if entry is None:
            raise BadRequest(f"no weight update group '{name}': call /init_weights_update_group first")
        pg, _store, backend = entry
        dev = device if backend == "nccl" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # NCCL binds its communicator to the current device of this thread
        out = {}
        for n, dt, shape in zip(names, dtypes, shapes):
            dtype = getattr(torch, str(dt).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise BadRequest(f"unknown dtype '{dt}' for '{n}'")
            t = torch.empty([int(s) for s in shape], dtype=dtype, device=dev)
            try:
                broadcast(pg, t)
            except RuntimeError as exc:
                raise BadRequest(f"update_weights_from_distributed: receiving '{n}' failed: {exc}") from None
            out[n] = t
        return out
