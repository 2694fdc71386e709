"""Contract checks a plugin's own tests can call on what it registers.

A check fails with an AssertionError, or with the PluginError that a run would stop with (the estimator and
loss checks call the component as the run does, through the same checks of what it returns).
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import torch

from miles_core.algorithms.config import AlgorithmConfig
from miles_core.config.loader import load_config
from miles_core.config.schema import MilesConfig
from miles_core.orchestration.plugin_calls import checked_estimator, checked_loss
from miles_core.rewards.custom import check_reward_fn
from miles_core.rewards.runner import is_reward_value
from miles_core.types import AdvantageInputs, AdvantageOutputs, LossInputs, LossOutput, Sample


def tiny_config(tmp_path: Path, *overrides: str) -> MilesConfig:
    base = [
        f"run.output_dir={tmp_path / 'runs'}",
        "run.num_rollout=2",
        "run.eval_every=1",
        "model.hidden_size=32",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.num_kv_heads=1",
        "model.intermediate_size=64",
        "data.num_eval=8",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_response_len=4",
    ]
    return load_config(None, base + list(overrides))


def check_reward(fn, name: str = "reward") -> None:
    """A reward accepts one Sample and returns a finite number (or an awaitable of one)."""
    check_reward_fn(fn, name)
    sample = Sample(prompt="1+1=", prompt_ids=[1], response_ids=[2], response="2", rollout_logprobs=[0.0], label="2")
    value = fn(sample)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    assert is_reward_value(value), f"{name} returned {value!r}, not a finite number"


async def _awaited(value):
    return await value


def check_advantage_estimator(fn, cfg: AlgorithmConfig | None = None) -> AdvantageOutputs:
    """An estimator returns [N, T] advantages that are zero on padding. It gets ``old_logprobs`` only if it sets
    ``fn.needs_old_logprobs = True``: a default run gives it None (the training forward stands in for them)."""
    cfg = cfg or AlgorithmConfig()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        response_mask=mask,
        old_logprobs=torch.full_like(mask, -1.0) * mask if getattr(fn, "needs_old_logprobs", False) else None,
    )
    out = checked_estimator(fn, f"advantage estimator {getattr(fn, '__name__', fn)!r}", inputs, cfg)
    assert out.advantages.shape == mask.shape, f"advantages have shape {tuple(out.advantages.shape)}, expected {tuple(mask.shape)}"
    assert torch.all(out.advantages[mask == 0] == 0), "advantages must be zero where response_mask is zero"
    assert torch.isfinite(out.advantages).all()
    return out


def check_policy_loss(fn, cfg: AlgorithmConfig | None = None) -> LossOutput:
    """A loss returns a per-token [N, T] loss that has a gradient w.r.t. the logprobs. It gets the entropy, which the
    built-in trainers always give."""
    cfg = cfg or AlgorithmConfig()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    inputs = LossInputs(logp, torch.full((2, 3), -1.1), torch.tensor([[1.0, 1.0, 0], [-1.0, 0, 0]]), mask,
                        entropy=torch.full((2, 3), 0.7) * mask)
    out = checked_loss(fn, cfg, f"policy loss {getattr(fn, '__name__', fn)!r}", inputs)
    assert out.loss.shape == mask.shape, f"loss has shape {tuple(out.loss.shape)}, expected per-token {tuple(mask.shape)}"
    (out.loss * mask).sum().backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    return out
