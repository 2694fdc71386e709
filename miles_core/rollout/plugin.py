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


def engine_config(r) -> EngineConfig | None:
    """The engine settings ``rollout.*`` overrides (None: all the engine's defaults)."""
    if not r.decode_steps and not r.kv_memory_fraction and r.cpu_kernels == "auto":
        return None
    engine = EngineConfig(max_num_seqs=min(r.max_batch_size, 256))
    if r.decode_steps:
        engine.decode_steps = r.decode_steps
    if r.kv_memory_fraction:
        engine.kv_memory_fraction = r.kv_memory_fraction
    engine.cpu_kernels = r.cpu_kernels
    return engine


def _builtin(ctx, model):
    cfg = ctx.config
    precision = ctx.plugins.registries.precision_recipes.get(cfg.train.precision, key="train.precision")
    engine = engine_config(cfg.rollout)
    return BuiltinEngine(
        model, ctx.tokenizer, ctx.device, cfg.rollout.max_batch_size, seed=cfg.run.seed,
        config=engine, dtype=engine_dtype(cfg.rollout.dtype, precision, ctx.device), precision=precision,
        kernels=ctx.kernels,
    )


@hookimpl
def miles_register_rollout_backends(registry: Registry) -> None:
    registry.add("builtin", _builtin)
    registry.add("sglang", sglang_backend)
