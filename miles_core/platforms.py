"""Hardware platforms. The core knows the CPU and CUDA; a plugin adds others (ROCm, ...)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles_core.errors import ConfigError
from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry


@dataclass(frozen=True)
class Platform:
    name: str
    device_type: str  # the torch device type
    is_available: Callable[[], bool]
    priority: int = 0  # platform=auto picks the available platform with the highest priority


def _cuda_available() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


def select_platform(registry: Registry, device: str, option: str = "run.device") -> tuple[Platform, torch.device]:
    """The platform and device for ``device`` (auto, cpu, cuda, cuda:N, ...); errors name it as ``option``."""
    if device == "auto":
        available = [p for p in (e.value for e in registry) if p.is_available()]
        if not available:
            raise ConfigError("no platform is available; is the 'miles.platforms' plugin blocked?")
        best = max(available, key=lambda p: p.priority)
        return best, torch.device(best.device_type)
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"{option} '{device}' is not a torch device (try auto, cpu or cuda)") from None
    for entry in registry:
        if entry.value.device_type == dev.type and entry.value.is_available():
            return entry.value, dev
    raise ConfigError(f"{option} '{device}' is not available on this machine (try auto)")


@hookimpl
def miles_register_platforms(registry: Registry) -> None:
    registry.add("cpu", Platform("cpu", "cpu", lambda: True, priority=0))
    registry.add("cuda", Platform("cuda", "cuda", _cuda_available, priority=10))
