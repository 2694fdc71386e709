"""``sglang_tensor`` weight transport: the tensors themselves in the JSON body of
``/update_weights_from_tensor``, in buckets (``sync.bucket_mb``), as `miles serve` accepts them:
``named_tensors`` = ``[{name, dtype, shape, data}]`` with ``data`` the base64 of the raw bytes.

Buckets are capped at 32 MB of raw tensor bytes (``--max-request-bytes`` of `miles serve` is 64 MB
by default). For small models: every byte is base64-encoded (4/3 larger) and parsed by the server. SGLang's
own ``serialized_named_tensors`` hand over CUDA-IPC handles and only work when trainer and engine
share the GPU host; use ``disk`` or ``distributed`` with a real SGLang server.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

import torch

from miles_core.errors import ConfigError
from miles_core.sync.buckets import buckets, dtype_name


def encode(name: str, t: torch.Tensor) -> dict:
    t = t.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"name": name, "dtype": dtype_name(t), "shape": list(t.shape), "data": base64.b64encode(raw).decode()}


class TensorTransport:
    MAX_BUCKET = 32 << 20  # raw bytes; base64 makes ~43 MB, under miles serve's default 64 MB request limit

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = min(bucket_bytes, self.MAX_BUCKET)

    def push(self, weights: Mapping[str, torch.Tensor], version: int, backend) -> None:
        if not hasattr(backend, "engine_urls"):
            raise ConfigError(f"sync.transport=sglang_tensor needs an HTTP rollout backend (rollout.backend=sglang), not {type(backend).__name__}")
        if getattr(backend, "kind", "") == "sglang":
            raise ConfigError("sync.transport=sglang_tensor speaks miles serve's named_tensors; with SGLang servers use disk or distributed")
        with backend.weights_lock:
            for part in buckets(weights, self.bucket_bytes):
                body = {"named_tensors": [encode(n, t) for n, t in part], "weight_version": str(version)}
                backend.broadcast_post("/update_weights_from_tensor", body)
            backend.remember(version, state=weights)
