"""A standalone process group for weight sync (trainer = rank 0, engine ranks after it).

It is built from its own TCPStore and never touches torch.distributed's default group, so a
trainer that already runs under torchrun/FSDP and a server process can both join it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from miles_core.errors import ConfigError


def host_store(master_address: str, world_size: int, timeout_s: float = 120.0) -> dist.TCPStore:
    """Rank 0's store, listening on a port the OS picks when it binds (``store.port``, to send to the
    other ranks): no port is chosen first and bound later, so no other process can take it between."""
    return dist.TCPStore(master_address, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def make_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               timeout_s: float = 120.0, store: dist.TCPStore | None = None):
    """Join the group ``group_name`` as ``rank`` through the store at ``master_address:master_port``
    (rank 0 passes the one :func:`host_store` made). Blocks until all ranks joined."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("sync.dist_backend=nccl needs CUDA on both the trainer and the engines")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise ConfigError(f"weight-sync backend must be gloo or nccl, got '{backend}'")
    return pg, store  # keep the store alive as long as the group


def broadcast(pg, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from rank 0 (in place on the receivers)."""
    pg.broadcast(tensor, 0).wait()
