"""The miles_nvidia plugin: what it adds to a run, through the hooks (nothing on import).

* kernels (platform ``cuda``, priority 10, over the core's torch references): ``logprobs``
  (fused linear + logprob + entropy), ``rmsnorm``, ``swiglu``, ``rope``;
* precision recipes: ``fp8`` (blockwise FP8 linears) and ``bf16_batch_invariant``;
* weight transports: ``nccl`` (bucketed broadcast over a torch.distributed group) and
  ``cuda_ipc`` (same-GPU handles for a colocated engine process), ``cuda_ipc_fp8`` (the same,
  shipping block-scaled FP8 weights).

Without Triton (>= 3.2, as pyproject.toml asks; ``pip install --no-deps`` or a CPU-only torch leaves it out)
the kernels are not registered (the core's references serve) and the two recipes are stand-ins that refuse
the run as it starts, saying why; the transports need no Triton.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

import torch

from miles_core.hookspecs import hookimpl
from miles_core.kernels.base import KernelImpl
from miles_core.plugins.registry import Registry
from miles_core.precision.base import PrecisionRecipe

PLATFORMS = ("cuda",)
MIN_TRITON = (3, 2)


def triton_missing() -> str | None:
    """Why the plugin's Triton kernels cannot be used here (Triton absent or older than MIN_TRITON), or None."""
    try:
        import triton
    except ImportError as exc:
        return f"Triton is not installed ({exc}); pip install 'triton>={MIN_TRITON[0]}.{MIN_TRITON[1]}'"
    version = getattr(triton, "__version__", None) or importlib.metadata.version("triton")
    found = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if found < MIN_TRITON:
        return f"Triton {version} is older than {MIN_TRITON[0]}.{MIN_TRITON[1]}; pip install -U 'triton>={MIN_TRITON[0]}.{MIN_TRITON[1]}'"
    return None


@dataclass(frozen=True)
class NeedsTriton(PrecisionRecipe):
    """A recipe of this plugin registered where Triton is missing: selecting it refuses the run at start-up."""

    why: str = ""

    def unavailable(self, device: torch.device) -> str | None:
        return f"miles_nvidia's '{self.name}' recipe needs Triton: {self.why}"


@hookimpl
def miles_register_kernels(registry: Registry) -> None:
    if triton_missing():
        return
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
    if why := triton_missing():
        registry.add("fp8", NeedsTriton("fp8", why=why))
        registry.add("bf16_batch_invariant", NeedsTriton("bf16_batch_invariant", why=why))
        return
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
