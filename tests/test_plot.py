"""curves.png: what a run's records draw, including runs of one step and steps without a reward."""

import numpy as np
from PIL import Image

from miles_core.observe.plot import plot_curves

REWARD_RGB = (0x25, 0x63, 0xEB)  # the train reward line's colour


def _reward_pixels(records, png) -> int:
    plot_curves(records, png)
    rgb = np.asarray(Image.open(png).convert("RGB"))
    return int((rgb == REWARD_RGB).all(axis=-1).sum())


def test_a_reward_of_one_step_or_between_missing_steps_is_drawn(tmp_path):
    """A line needs two neighbouring points: the reward of a one-step run (or of a step between two without a reward,
    NaN where dynamic sampling kept no group) drew nothing but the legend."""
    legend_only = _reward_pixels([{"phase": "rl", "step": 0, "eval_accuracy": 0.2}], tmp_path / "none.png")
    one_step = _reward_pixels([{"phase": "rl", "step": 0, "eval_accuracy": 0.2}, {"phase": "rl", "step": 1, "reward_mean": 0.5}],
                              tmp_path / "one.png")
    assert one_step > legend_only + 5
    nan = float("nan")
    gaps = [{"phase": "rl", "step": s, "reward_mean": r} for s, r in enumerate([0.2, nan, 0.4, nan, 0.6], 1)]
    all_missing = [{"phase": "rl", "step": s, "reward_mean": nan} for s in range(1, 6)]
    assert _reward_pixels(gaps, tmp_path / "gaps.png") > _reward_pixels(all_missing, tmp_path / "missing.png") + 15


EVAL_RGB = (0x16, 0xA3, 0x4A)  # the held-out accuracy line's colour


def test_an_sft_run_draws_its_held_out_accuracy(tmp_path):
    """run.mode=sft logs its steps (and evals) as phase 'sft': its curves.png drew nothing but the legend."""
    def eval_pixels(records, png):
        plot_curves(records, png)
        return int((np.asarray(Image.open(png).convert("RGB")) == EVAL_RGB).all(axis=-1).sum())

    sft = [{"phase": "sft", "step": s, "nll": 2.0 - s / 4, **({"eval_accuracy": s / 4} if s % 2 == 0 else {})} for s in range(5)]
    legend_only = eval_pixels([{"phase": "sft", "step": 1, "nll": 2.0}], tmp_path / "none.png")
    assert eval_pixels(sft, tmp_path / "sft.png") > legend_only + 50
