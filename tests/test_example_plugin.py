"""A third-party plugin from examples/, pip-installed, registers a reward that a run then uses."""

import json
import os
import subprocess
import sys
from pathlib import Path

from miles_core.testing.contracts import check_reward

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "miles-reward-plugin"


def test_installed_example_plugin_is_listed_and_used(tmp_path, cli):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(EXAMPLE)],
        check=True, capture_output=True, text=True,
    )
    env = {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    plugins = {p["name"]: p for p in json.loads(cli("plugins", "--json", env=env).stdout)}
    assert plugins["reward_example"]["version"] == "0.2.0"
    assert plugins["reward_example"]["registered"] == {"rewards": ["digits_match"]}
    out = cli(
        "run", "reward.name=digits_match", "run.num_rollout=2", "run.eval_every=1", "train.sft_warmup_steps=0",
        "data.num_eval=8", "rollout.batch_size=4", "model.hidden_size=32", "model.num_layers=1",
        f"run.output_dir={tmp_path / 'runs'}", env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "reward digits_match" in out.stdout
    (run_dir,) = list((tmp_path / "runs").iterdir())
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["eval_reward"] <= 1.0 for r in rows if "eval_reward" in r)
    # blocking it removes the reward
    out = cli("validate", "reward.name=digits_match", "-p", "no:reward_example", env=env)
    assert out.returncode == 2 and "unknown reward 'digits_match'" in out.stderr


def test_example_reward_meets_the_contract():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from miles_reward_example.plugin import digits_match
    finally:
        sys.path.remove(str(EXAMPLE))
    check_reward(digits_match, "digits_match")
    from miles_core.types import Sample

    def score(response, label="12"):
        return digits_match(Sample("q", [1], [2], response, [0.0], label=label))

    # position by position, over the longer of the two: all right, one of two, two of three, none, no label
    assert [score("12"), score(" 13 "), score("123"), score("21"), score("x", label="")] == [1.0, 0.5, 2 / 3, 0.0, 0.0]
