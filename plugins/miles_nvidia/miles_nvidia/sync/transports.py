"""The ``nccl`` and ``cuda_ipc`` weight transports.

``nccl`` (disaggregated engines): the trainer rank broadcasts each bucket over a torch.distributed
group that the engine ranks joined; an engine-side proxy backend implements
``begin_weight_broadcast(plans, version)`` (start receiving: :func:`broadcast_recv`) and
``finish_weight_broadcast()`` (wait and load). With the gloo backend the same code runs on CPU.

``cuda_ipc`` (colocated engines, another process on the same GPU): each bucket is packed on the GPU
and sent through a ``torch.multiprocessing`` pipe, whose pickler turns CUDA tensors into IPC
handles (CPU tensors into shared memory), so no bytes cross the pipe. The engine process runs
:func:`serve_ipc_updates`; the trainer holds an :class:`IpcEngineProxy` as its backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from miles_core.errors import ConfigError
from miles_nvidia.fp8.export import SUFFIX, dequantize_fp8, export_fp8
from miles_nvidia.sync.buckets import DEFAULT_BUCKET_BYTES, BucketPlan, metas_of, pack, plan_buckets, unpack


def broadcast_send(weights: Mapping[str, torch.Tensor], plans: list[BucketPlan], src: int, group=None, device=None) -> None:
    device = device or next(iter(weights.values())).device
    for plan in plans:
        buf = pack(weights, plan, device)
        dist.broadcast(buf, src=src, group=group)


def broadcast_recv(plans: list[BucketPlan], src: int, group=None, device="cpu") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for plan in plans:
        buf = torch.empty(plan.numel, dtype=plan.dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        out.update(unpack(buf, plan))
    return out


class BroadcastReceiver(Protocol):
    def begin_weight_broadcast(self, plans: list[BucketPlan], version: int) -> None: ...

    def finish_weight_broadcast(self) -> None: ...


class NcclTransport:
    def __init__(self, src: int = 0, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.src, self.group, self.bucket_bytes = src, group, bucket_bytes

    def push(self, weights: Mapping[str, torch.Tensor], version: int, backend: Any) -> None:
        if not hasattr(backend, "begin_weight_broadcast"):
            raise ConfigError(
                "sync.transport=nccl needs a rollout backend in other processes that joins the broadcast "
                "(begin_weight_broadcast); with the in-process engine use sync.transport=in_process"
            )
        plans = plan_buckets(metas_of(weights), self.bucket_bytes)
        backend.begin_weight_broadcast(plans, version)
        broadcast_send(weights, plans, self.src, self.group)
        backend.finish_weight_broadcast()


# the core's rollout backends: the built-in engine runs in the trainer's process and the sglang backend syncs
# through its server; neither joins a broadcast (begin_weight_broadcast) nor takes IPC handles (update_weights_ipc)
CORE_BACKENDS = {"builtin": "in_process", "sglang": "sglang_tensor, distributed or disk"}


def check_engine_process_backend(ctx, transport: str) -> None:
    """Refuse at start-up what ``push`` would refuse at the first weight sync: a core rollout backend."""
    backend = ctx.config.rollout.backend
    if backend in CORE_BACKENDS:
        raise ConfigError(
            f"sync.transport={transport} hands weights to an engine in another process, which rollout.backend={backend} "
            f"is not; use sync.transport={CORE_BACKENDS[backend]}"
        )


def make_nccl(ctx) -> NcclTransport:
    check_engine_process_backend(ctx, "nccl")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("sync.transport=nccl needs torch.distributed initialised (trainer and engines in one group)")
    return NcclTransport(src=dist.get_rank())


class IpcEngineProxy:
    """The trainer's handle on an engine in another process; ``conn`` is one end of a
    ``torch.multiprocessing.Pipe``."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.weight_version = 0

    def update_weights_ipc(self, buffers: list[torch.Tensor], plans: list[BucketPlan], version: int) -> None:
        self.conn.send(("weights", buffers, plans, version))
        reply = self.conn.recv()  # the engine has copied out of the buffers: they may be freed now
        if reply != ("ok", version):
            raise RuntimeError(f"engine answered {reply!r} to weight version {version}")
        self.weight_version = version

    def close(self) -> None:
        self.conn.send(("stop",))


def serve_ipc_updates(conn, engine) -> None:
    """Engine-process loop: load each weight version sent by :class:`IpcTransport` until "stop"."""
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        _, buffers, plans, version = msg
        weights: dict[str, torch.Tensor] = {}
        for buf, plan in zip(buffers, plans):
            weights.update(unpack(buf, plan))
        if any(name.endswith(SUFFIX) for name in weights):  # sent as FP8 blocks: back to the engine's dtype
            dtype = next(iter(engine.model.parameters())).dtype if hasattr(engine, "model") else torch.bfloat16
            weights = dequantize_fp8(weights, dtype)
        engine.update_weights(weights, version)
        if buffers and buffers[0].is_cuda:
            torch.cuda.synchronize(buffers[0].device)
        del weights, buffers
        conn.send(("ok", version))


class IpcTransport:
    """``fp8=True`` ships the projection weights as 128x128-block e4m3 + ``weight_scale_inv``
    (:mod:`miles_nvidia.fp8.export`, about half the bytes of bf16); the engine side dequantises."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, fp8: bool = False) -> None:
        self.bucket_bytes, self.fp8 = bucket_bytes, fp8

    def push(self, weights: Mapping[str, torch.Tensor], version: int, backend: Any) -> None:
        if not hasattr(backend, "update_weights_ipc"):
            raise ConfigError("sync.transport=cuda_ipc needs an engine in another process (IpcEngineProxy); "
                              "with the in-process engine use sync.transport=in_process")
        if self.fp8:
            weights = export_fp8(weights)
        plans = plan_buckets(metas_of(weights), self.bucket_bytes)
        device = next(iter(weights.values())).device
        buffers = [pack(weights, p, device) for p in plans]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the packed bytes must exist before the other process reads them
        backend.update_weights_ipc(buffers, plans, version)


def make_cuda_ipc(ctx) -> IpcTransport:
    check_engine_process_backend(ctx, "cuda_ipc")
    return IpcTransport()


def make_cuda_ipc_fp8(ctx) -> IpcTransport:
    check_engine_process_backend(ctx, "cuda_ipc_fp8")
    return IpcTransport(fp8=True)
