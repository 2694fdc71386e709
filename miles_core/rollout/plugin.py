from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry
from miles_core.rollout.engine import BuiltinEngine


def _builtin(ctx, model):
    cfg = ctx.config
    return BuiltinEngine(model, ctx.tokenizer, ctx.device, cfg.rollout.max_batch_size, seed=cfg.run.seed)


@hookimpl
def miles_register_rollout_backends(registry: Registry) -> None:
    registry.add("builtin", _builtin)
