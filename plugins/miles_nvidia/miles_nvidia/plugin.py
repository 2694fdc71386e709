"""The miles_nvidia plugin: what it adds to a run, through the hooks (nothing on import).

* kernels (platform ``cuda``, priority 10, over the core's torch references): ``logprobs``
  (fused linear + logprob + entropy), ``rmsnorm``, ``swiglu``, ``rope``;
* precision recipes: ``fp8`` (blockwise FP8 linears) and ``bf16_batch_invariant``;
* weight transports: ``nccl`` (bucketed broadcast over a torch.distributed group) and
  ``cuda_ipc`` (same-GPU handles for a colocated engine process), ``cuda_ipc_fp8`` (the same,
  shipping block-scaled FP8 weights).
"""

from __future__ import annotations

from miles_core.hookspecs import hookimpl
from miles_core.kernels.base import KernelImpl
from miles_core.plugins.registry import Registry

PLATFORMS = ("cuda",)


@hookimpl
def miles_register_kernels(registry: Registry) -> None:
    from miles_nvidia.kernels.logprobs import logprobs_triton
    from miles_nvidia.kernels.rmsnorm import rmsnorm_triton
    from miles_nvidia.kernels.rope import rope_triton
    from miles_nvidia.kernels.swiglu import swiglu_triton

    registry.add("logprobs.triton", KernelImpl("logprobs", logprobs_triton, PLATFORMS, priority=10))
    registry.add("rmsnorm.triton", KernelImpl("rmsnorm", rmsnorm_triton, PLATFORMS, priority=10))
    registry.add("swiglu.triton", KernelImpl("swiglu", swiglu_triton, PLATFORMS, priority=10))
    registry.add("rope.triton", KernelImpl("rope", rope_triton, PLATFORMS, priority=10))


@hookimpl
def miles_register_precision_recipes(registry: Registry) -> None:
    from miles_nvidia.batch_invariant.mode import BatchInvariantRecipe
    from miles_nvidia.fp8.linear import Fp8Recipe

    registry.add("fp8", Fp8Recipe())
    registry.add("bf16_batch_invariant", BatchInvariantRecipe())


@hookimpl
def miles_register_weight_transports(registry: Registry) -> None:
    from miles_nvidia.sync.transports import make_cuda_ipc, make_cuda_ipc_fp8, make_nccl

    registry.add("nccl", make_nccl)
    registry.add("cuda_ipc", make_cuda_ipc)
    registry.add("cuda_ipc_fp8", make_cuda_ipc_fp8)
