from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError


@dataclass
class SyncConfig:
    transport: str = "in_process"  # a registered weight transport: in_process | disk | distributed | sglang_tensor
    bucket_mb: float = 256.0  # distributed / sglang_tensor: tensors are sent in buckets of about this size
    disk_dir: str = ""  # disk: where versions are written ("" = <output_dir>/weights)
    dist_backend: str = "auto"  # distributed: gloo | nccl | auto (nccl when the trainer is on CUDA)
    master_address: str = "127.0.0.1"  # distributed: the trainer's address, as the engines reach it

    def validate(self) -> None:
        if self.bucket_mb <= 0:
            raise ConfigError(f"sync.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.dist_backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"sync.dist_backend must be auto, gloo or nccl, got '{self.dist_backend}'")
