"""miles_core.testing: the contract checks and the pytest plugin, used as a plugin author would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_core.errors import PluginError
from miles_core.testing.contracts import check_advantage_estimator, check_policy_loss, check_reward
from miles_core.types import AdvantageOutputs, LossOutput


def test_check_reward_awaits_an_async_reward():
    # the hookspec allows a reward to return an awaitable of a float; the check called it a coroutine, not a number
    async def verified(sample):
        return 1.0

    async def broken(sample):
        return float("nan")

    check_reward(verified, "verified")
    with pytest.raises(AssertionError, match="broken returned nan"):
        check_reward(broken, "broken")


def test_checks_refuse_what_a_run_refuses():
    # a tensor metric passed check_policy_loss and then failed the run when its metrics were written
    def tensor_metric(inputs, cfg):
        return LossOutput(-inputs.advantages * inputs.logprobs, {"ratio": inputs.logprobs.mean()})

    with pytest.raises(PluginError, match="metric 'ratio' as a Tensor"):
        check_policy_loss(tensor_metric)

    class Lookalike:  # has .advantages, but is not the documented AdvantageOutputs
        def __init__(self, advantages):
            self.advantages = advantages

    with pytest.raises(PluginError, match="returned a Lookalike"):
        check_advantage_estimator(lambda inputs, cfg: Lookalike(inputs.rewards[:, None] * inputs.response_mask))
    check_advantage_estimator(lambda inputs, cfg: AdvantageOutputs(inputs.rewards[:, None] * inputs.response_mask))


def test_estimator_check_gives_old_logprobs_only_as_a_run_does():
    # a default run (train.old_logprobs=auto, one update per rollout, no KL, teacher or critic) gives the estimator
    # old_logprobs=None; the check gave a tensor, so an estimator reading them passed it and then failed every run
    def surprise(inputs, cfg):
        return AdvantageOutputs((inputs.rewards[:, None] - 0.01 * inputs.old_logprobs) * inputs.response_mask)

    with pytest.raises(PluginError, match="surprise.*TypeError"):
        check_advantage_estimator(surprise)
    surprise.needs_old_logprobs = True  # the run then computes them, and the check gives them
    check_advantage_estimator(surprise)


def test_loss_check_gives_entropy_as_the_trainers_do():
    # the torch and Megatron trainers always give the loss the policy's entropy; the check gave None, so a loss
    # with an entropy bonus (valid in every run) failed its contract check, and ppo_clip's was never exercised
    def bonus(inputs, cfg):
        return LossOutput(-inputs.advantages * inputs.logprobs - 0.01 * inputs.entropy, {})

    check_policy_loss(bonus)


def test_pytest_plugin_registers_the_gpu_marker(tmp_path):
    # a plugin's own test suite run with --strict-markers failed to collect a @pytest.mark.gpu test
    (tmp_path / "test_mine.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n\n"
        "def test_fixtures(miles_plugins, miles_tiny_config):\n"
        "    assert 'exact_match' in miles_plugins.registries.rewards\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--strict-markers", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("1 passed, 1 skipped" if not torch.cuda.is_available() else "2 passed") in out.stdout
