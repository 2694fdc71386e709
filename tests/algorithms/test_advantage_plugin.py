"""The example plugin in examples/miles-advantage-plugin: installed with pip, found through its
entry point, and used for a tiny run."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from miles_core.observe.metrics import read_metrics

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


def test_estimator_by_hand(installed, tmp_path):
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
        # its baseline is the group's median: a group of one gets 0, so a run with one sample per prompt is refused
        from miles_core.errors import ConfigError
        from miles_core.orchestration.checks import check_algorithm
        from miles_core.testing.contracts import tiny_config

        cfg = tiny_config(tmp_path, "rollout.n_samples_per_prompt=1", "algorithm.advantage_estimator=median_baseline")
        with pytest.raises(ConfigError, match="n_samples_per_prompt >= 2"):
            check_algorithm(cfg, median_baseline)
    finally:
        sys.path.remove(str(installed[0]))


def test_plugin_is_listed_and_runs(installed, tmp_path):
    _, env = installed
    cli = [sys.executable, "-m", "miles_cli.main"]
    listed = subprocess.run([*cli, "plugins", "--json"], env=env, capture_output=True, text=True, check=True)
    info = {p["name"]: p for p in json.loads(listed.stdout)}
    assert info["median-baseline"]["registered"] == {"advantage_estimators": ["median_baseline"]}
    assert info["median-baseline"]["version"] == "0.1.0"
    # the run itself goes in process (a second CLI start costs ~10 s on a loaded 2-core machine);
    # the entry point is found the same way, through the installed dist-info on sys.path
    sys.path.insert(0, str(installed[0]))
    try:
        from miles_core.testing.contracts import tiny_config
        from miles_core.orchestration.run import run
        from miles_core.plugins.manager import MilesPlugins

        plugins = MilesPlugins(autoload=True)
        assert "median_baseline" in plugins.registries.advantage_estimators
        cfg = tiny_config(tmp_path, "run.num_threads=1", "data.task_options={max_value: 9}", "rollout.n_samples_per_prompt=4",
                          "train.sft_warmup_steps=2", "algorithm.advantage_estimator=median_baseline")
        summary = run(cfg, plugins, Console(file=io.StringIO()))
    finally:
        sys.path.remove(str(installed[0]))
    assert summary["status"] == "completed" and summary["steps"] == 2
    records = read_metrics(Path(summary["output_dir"]) / "metrics.jsonl")
    assert all("adv_mean" in r for r in records if r["phase"] == "rl" and r["step"] > 0)
