from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry
from miles_core.train.torch_trainer import TorchTrainer


def _torch(ctx, model):
    precision = ctx.plugins.registries.precision_recipes.get(ctx.config.train.precision, key="train.precision")
    return TorchTrainer(model, ctx.config, ctx.device, precision, ctx.kernels)


@hookimpl
def miles_register_trainers(registry: Registry) -> None:
    registry.add("torch", _torch)
