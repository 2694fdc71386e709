"""The core's reference kernels: plain torch, every platform, lowest priority."""

from miles_core.hookspecs import hookimpl
from miles_core.kernels.base import KernelImpl
from miles_core.kernels.logprobs import logprobs_torch
from miles_core.plugins.registry import Registry


@hookimpl
def miles_register_kernels(registry: Registry) -> None:
    registry.add("logprobs.torch", KernelImpl("logprobs", logprobs_torch, ("*",), priority=0))
