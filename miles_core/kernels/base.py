"""Kernel registry types: an op has one torch reference and any number of hardware versions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_core.plugins.manager import MilesPlugins


@dataclass(frozen=True)
class KernelImpl:
    op: str  # e.g. "logprobs"
    fn: Callable[..., Any]
    platforms: tuple[str, ...]  # platform names it runs on; ("*",) for any
    priority: int = 0  # the highest priority among candidates serves, unless a plugin chooses


class Kernels:
    """The implementation of each op chosen for one platform, resolved once per run."""

    def __init__(self, plugins: MilesPlugins, platform: str) -> None:
        self.platform = platform
        self._chosen: dict[str, KernelImpl] = {}
        by_op: dict[str, list[KernelImpl]] = {}
        for entry in plugins.registries.kernels:
            impl = entry.value
            if "*" in impl.platforms or platform in impl.platforms:
                by_op.setdefault(impl.op, []).append(impl)
        for op, candidates in by_op.items():
            candidates.sort(key=lambda k: -k.priority)
            self._chosen[op] = plugins.kernel_select(op, platform, candidates) or candidates[0]

    def get(self, op: str, default: Callable[..., Any] | None = None) -> Callable[..., Any] | None:
        impl = self._chosen.get(op)
        return default if impl is None else impl.fn

    def __getitem__(self, op: str) -> Callable[..., Any]:
        try:
            return self._chosen[op].fn
        except KeyError:
            from miles_core.errors import PluginError

            raise PluginError(
                f"no kernel serves op '{op}' on platform '{self.platform}'; is the 'miles.kernels' plugin blocked?"
            ) from None

    def chosen(self) -> dict[str, KernelImpl]:
        return dict(self._chosen)
