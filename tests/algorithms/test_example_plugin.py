"""The example plugin in examples/miles-advantage-plugin: installed with pip, found through its
entry point, and used for a tiny run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "miles-advantage-plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--target", str(target), str(EXAMPLE)],
        check=True, cwd=tmp_path_factory.mktemp("build"),
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), *sys.path])
    env.pop("MILES_DISABLE_PLUGIN_AUTOLOAD", None)
    return target, env


def test_estimator_by_hand(installed):
    sys.path.insert(0, str(installed[0]))
    try:
        from miles_advantage_plugin import median_baseline
        from miles_core.algorithms.config import AlgorithmConfig
        from miles_core.testing.contracts import check_advantage_estimator
        from miles_core.types import AdvantageInputs

        mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
        x = AdvantageInputs(torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 0, 1, 1]), mask)
        out = median_baseline(x, AlgorithmConfig())
        assert torch.allclose(out.advantages, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
        check_advantage_estimator(median_baseline)
    finally:
        sys.path.remove(str(installed[0]))


def test_plugin_is_listed_and_runs(installed, tmp_path):
    _, env = installed
    cli = [sys.executable, "-m", "miles_cli.main"]
    listed = subprocess.run([*cli, "plugins", "--json"], env=env, capture_output=True, text=True, check=True)
    info = {p["name"]: p for p in json.loads(listed.stdout)}
    assert info["median-baseline"]["registered"] == {"advantage_estimators": ["median_baseline"]}
    assert info["median-baseline"]["version"] == "0.1.0"
    args = [
        f"run.output_dir={tmp_path}", "run.num_rollout=2", "run.num_threads=1", "data.task_options={max_value: 9}",
        "data.num_eval=8", "model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64",
        "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=3",
        "train.sft_warmup_steps=2", "algorithm.advantage_estimator=median_baseline",
    ]
    done = subprocess.run([*cli, "run", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
