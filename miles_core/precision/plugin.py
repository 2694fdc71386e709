import torch

from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry
from miles_core.precision.base import PrecisionRecipe


@hookimpl
def miles_register_precision_recipes(registry: Registry) -> None:
    registry.add("fp32", PrecisionRecipe("fp32"))
    # bf16 compute, fp32 master weights
    registry.add("bf16", PrecisionRecipe("bf16", torch.float32, torch.bfloat16))
