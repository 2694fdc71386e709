"""The built-in algorithms: advantage estimators and policy losses."""

from miles_core.algorithms.grpo import grpo
from miles_core.algorithms.losses import ppo_clip, sft
from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry


@hookimpl
def miles_register_advantage_estimators(registry: Registry) -> None:
    registry.add("grpo", grpo)


@hookimpl
def miles_register_policy_losses(registry: Registry) -> None:
    registry.add("ppo_clip", ppo_clip)
    registry.add("sft", sft)
