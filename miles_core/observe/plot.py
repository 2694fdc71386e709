"""Reward and held-out accuracy curves as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_core.models.checkpoint import atomic_file


def plot_curves(records: list[dict[str, Any]], png: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    own = [r for r in records if r.get("phase") == "rl"]
    phase = "RL"
    if not own:  # run.mode=sft: its steps and evals are phase 'sft' (an RL run's are its warm-up's, before its step 0)
        own, phase = [r for r in records if r.get("phase") == "sft"], "SFT"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [r["step"] for r in own if "reward_mean" in r]
    # markers: a line joins neighbouring points only, so a one-step run (or a step between two NaN ones) had none
    ax.plot(steps, [r["reward_mean"] for r in own if "reward_mean" in r], "o-", markersize=3, label="train reward (mean)",
            color="#2563eb")
    ev = [r for r in own if r.get("eval_accuracy") is not None]
    ax.plot([r["step"] for r in ev], [r["eval_accuracy"] for r in ev], "o-", label="held-out accuracy (greedy)", color="#16a34a")
    ax.set_xlabel(f"{phase} step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "Miles run")
    fig.tight_layout()
    try:
        return atomic_file(Path(png), lambda tmp: fig.savefig(tmp, format="png"))  # a viewer never reads half a PNG
    finally:
        plt.close(fig)
