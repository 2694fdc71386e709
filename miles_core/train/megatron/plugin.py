"""Registers the "megatron" trainer. megatron-core is imported inside the factory only."""

from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry


def _megatron(ctx, model):
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        from miles_core.errors import ConfigError

        raise ConfigError("train.backend=megatron needs megatron-core: pip install 'miles[megatron]'") from None
    from miles_core.train.megatron.arch import arch_from_decoder
    from miles_core.train.megatron.trainer import MegatronTrainer

    precision = ctx.plugins.registries.precision_recipes.get(ctx.config.train.precision, key="train.precision")
    trainer = MegatronTrainer(arch_from_decoder(model.config), model.state_dict(), ctx.config, ctx.device, precision, ctx.kernels)
    trainer.decoder_config = model.config  # written into config.json on HF export
    return trainer


@hookimpl
def miles_register_trainers(registry: Registry) -> None:
    registry.add("megatron", _megatron)
