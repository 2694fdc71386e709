"""The built-in algorithms: advantage estimators and policy losses, registered through the hooks.

A third-party plugin adds its own the same way (see examples/miles-advantage-plugin).
"""

from miles_core.algorithms.distill import distill
from miles_core.algorithms.gae import ppo
from miles_core.algorithms.grpo import grpo
from miles_core.algorithms.gspo import gspo, gspo_token
from miles_core.algorithms.losses import ppo_clip, sft
from miles_core.algorithms.reinforce import reinforce_plus_plus, reinforce_plus_plus_baseline
from miles_core.algorithms.rloo import rloo
from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry


@hookimpl
def miles_register_advantage_estimators(registry: Registry) -> None:
    registry.add("grpo", grpo)
    registry.add("rloo", rloo)
    registry.add("reinforce_plus_plus", reinforce_plus_plus)
    registry.add("reinforce_plus_plus_baseline", reinforce_plus_plus_baseline)
    registry.add("ppo", ppo)
    registry.add("distill", distill)


@hookimpl
def miles_register_policy_losses(registry: Registry) -> None:
    registry.add("ppo_clip", ppo_clip)
    registry.add("gspo", gspo)
    registry.add("gspo_token", gspo_token)
    registry.add("sft", sft)
