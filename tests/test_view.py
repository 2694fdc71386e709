"""The live view: what a person sees of each step, on a terminal and in a log file."""

import io

from rich.console import Console

from miles_core.observe.view import LiveView


def _sft_run(console):
    view = LiveView(console, 3, 0, phase="sft")
    with view:
        view.update({"phase": "sft", "step": 0, "eval_accuracy": 0.1, "eval_nll": 2.0})
        for s in (1, 2, 3):
            view.update({"phase": "sft", "step": s, "loss": 1.5 - s / 10, "time_step": 0.1, **({"eval_accuracy": 0.375} if s == 3 else {})})
    return view


def test_an_sft_run_shows_each_of_its_steps():
    """run.mode=sft: its steps were taken for RL warm-up steps: in a log one line 'sft warm-up 1/0' for the whole run
    (no eval accuracy), on a terminal an empty table and a bar that never moved."""
    buf = io.StringIO()
    _sft_run(Console(file=buf, width=200))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4 and "warm-up" not in buf.getvalue()
    assert lines[0].startswith("step 0 | eval acc 0.100") and lines[3].startswith("step 3 | eval acc 0.375 | loss 1.2000")
    view = _sft_run(Console(file=io.StringIO(), width=200, force_terminal=True))
    (task,) = [t for t in view.progress.tasks if t.visible]
    assert (task.completed, task.total) == (3, 3) and [r["step"] for r in view.rows] == [0, 1, 2, 3]


def test_miles_run_in_sft_mode_logs_its_steps(tmp_path):
    from miles_core.orchestration.run import run
    from miles_core.plugins.manager import MilesPlugins
    from miles_core.testing.contracts import tiny_config

    buf = io.StringIO()
    run(tiny_config(tmp_path, "run.mode=sft", "run.num_rollout=2"), MilesPlugins(autoload=False), Console(file=buf, width=300))
    steps = [line.split(" | ")[0] for line in buf.getvalue().splitlines() if line.startswith("step ")]
    assert steps == ["step 0", "step 1", "step 2"] and "warm-up" not in buf.getvalue()


def test_a_resumed_run_s_bar_counts_the_steps_it_had_done():
    """A run resumed after step 5 of 10 ended at '5/10' (the bar counted this process's steps from 0), its time left
    estimated for 10 steps when 5 remained, beside a warm-up bar at '0/4' (a resumed run skips its warm-up)."""
    view = LiveView(Console(file=io.StringIO(), force_terminal=True), 10, 4)
    with view:
        view.update({"phase": "rl", "step": 6, "reward_mean": 0.5})
        task = view.progress.tasks[view.rl_task]
        assert (task.completed, task.remaining) == (6, 4)
        assert [t.description for t in view.progress.tasks if t.visible] == ["rl steps"]
        for s in range(7, 11):
            view.update({"phase": "rl", "step": s, "reward_mean": 0.5})
    assert task.completed == 10 and task.finished
