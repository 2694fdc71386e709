from pathlib import Path

from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry
from miles_core.sync.disk import DiskTransport
from miles_core.sync.distributed import DistributedTransport
from miles_core.sync.in_process import InProcessTransport
from miles_core.sync.tensor import TensorTransport


def _disk(ctx):
    s = ctx.config.sync
    root = s.disk_dir or (Path(ctx.output_dir) / "weights" if ctx.output_dir else Path.cwd() / "miles_weights")
    return DiskTransport(root)


def _distributed(ctx):
    s = ctx.config.sync
    args = ctx.config.rollout.sglang.server_args
    ranks = int(args.get("tp_size", args.get("tp", 1)))
    return DistributedTransport(int(s.bucket_mb * 2**20), s.dist_backend, s.master_address, ranks)


@hookimpl
def miles_register_weight_transports(registry: Registry) -> None:
    registry.add("in_process", lambda ctx: InProcessTransport())
    registry.add("disk", _disk)
    registry.add("distributed", _distributed)
    registry.add("sglang_tensor", lambda ctx: TensorTransport(int(ctx.config.sync.bucket_mb * 2**20)))
