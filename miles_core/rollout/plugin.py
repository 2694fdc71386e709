import torch

from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry
from miles_core.rollout.engine import BuiltinEngine
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.sglang.factory import sglang_backend


def engine_dtype(name: str, precision, device: torch.device) -> torch.dtype | None:
    """``rollout.dtype`` -> the engine's weight dtype (None: keep the model's)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" and precision.compute_dtype is not None and not precision.batch_invariant:
        return precision.compute_dtype
    return None


def _builtin(ctx, model):
    cfg = ctx.config
    precision = ctx.plugins.registries.precision_recipes.get(cfg.train.precision, key="train.precision")
    engine = None
    if cfg.rollout.decode_steps:
        engine = EngineConfig(max_num_seqs=min(cfg.rollout.max_batch_size, 256), decode_steps=cfg.rollout.decode_steps)
    return BuiltinEngine(
        model, ctx.tokenizer, ctx.device, cfg.rollout.max_batch_size, seed=cfg.run.seed,
        config=engine, dtype=engine_dtype(cfg.rollout.dtype, precision, ctx.device), precision=precision,
        kernels=ctx.kernels,
    )


@hookimpl
def miles_register_rollout_backends(registry: Registry) -> None:
    registry.add("builtin", _builtin)
    registry.add("sglang", sglang_backend)
