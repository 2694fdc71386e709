"""The core's reference kernels: plain torch, every platform, lowest priority."""

from miles_core.hookspecs import hookimpl
from miles_core.kernels.base import KernelImpl
from miles_core.kernels.logprobs import logprobs_torch
from miles_core.kernels.rmsnorm import rmsnorm_torch
from miles_core.kernels.rope import rope_torch
from miles_core.kernels.swiglu import swiglu_torch
from miles_core.plugins.registry import Registry


@hookimpl
def miles_register_kernels(registry: Registry) -> None:
    registry.add("logprobs.torch", KernelImpl("logprobs", logprobs_torch, ("*",), priority=0))
    registry.add("rmsnorm.torch", KernelImpl("rmsnorm", rmsnorm_torch, ("*",), priority=0))
    registry.add("swiglu.torch", KernelImpl("swiglu", swiglu_torch, ("*",), priority=0))
    registry.add("rope.torch", KernelImpl("rope", rope_torch, ("*",), priority=0))
