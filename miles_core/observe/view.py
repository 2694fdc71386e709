"""What a person sees while a run goes: the plugins, a live table of steps, and a summary."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

COLUMNS = (
    ("step", "step", "{}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("train acc", "train_accuracy", "{:.2f}"),
    ("eval acc", "eval_accuracy", "{:.3f}"),
    ("loss", "loss", "{:.4f}"),
    ("resp len", "response_len", "{:.1f}"),
    ("tok/s", "rollout_tok_s", "{:,.0f}"),
    ("rollout s", "time_rollout", "{:.2f}"),
    ("train s", "time_train", "{:.2f}"),
    ("step s", "time_step", "{:.2f}"),
)


def plugins_table(infos) -> Table:
    table = Table(title="plugins", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("plugin")
    table.add_column("version")
    table.add_column("registered")
    for info in infos:
        reg = "; ".join(f"{k}: {', '.join(v)}" for k, v in info.registered.items())
        if not reg:  # an entry point naming a module without hooks (the package, not its plugin module) does nothing
            registers = any(h.startswith("miles_register_") for h in info.hooks)
            reg = "(registered nothing)" if registers else "(lifecycle hooks only)" if info.hooks else "(no hooks: it does nothing)"
        table.add_row(info.name, info.version, reg)
    return table


def _fmt(record: dict[str, Any], key: str, fmt: str) -> str:
    v = record.get(key)
    return "" if v is None else fmt.format(v)


class LiveView:
    """A live table of the last steps and a progress bar on a terminal; one line per step otherwise.

    ``phase`` is the phase of the run's own steps (``sft`` for run.mode=sft); the records of another (an RL run's SFT
    warm-up) advance the warm-up bar."""

    def __init__(self, console: Console, total_steps: int, warmup_steps: int, keep: int = 12, phase: str = "rl") -> None:
        self.console = console
        self.warmup_steps = warmup_steps
        self.phase = phase
        self.rows: list[dict[str, Any]] = []
        self.stepped = False  # a step of the run's own (not its step-0 eval) was shown
        self.keep = keep
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            console=console,
        )
        self.warm_task = self.progress.add_task("sft warm-up", total=warmup_steps, visible=warmup_steps > 0)
        self.rl_task = self.progress.add_task(f"{phase} steps", total=total_steps)
        self.live = Live(self._render(), console=console, refresh_per_second=4) if console.is_terminal else None

    def _table(self) -> Table:
        table = Table(show_edge=False, pad_edge=False)
        for title, _, _ in COLUMNS:
            table.add_column(title, justify="right")
        for r in self.rows[-self.keep :]:
            table.add_row(*(_fmt(r, key, fmt) for _, key, fmt in COLUMNS))
        return table

    def _render(self):
        return Group(self._table(), self.progress)

    def __enter__(self) -> "LiveView":
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, record: dict[str, Any]) -> None:
        if record.get("phase") != self.phase:
            self.progress.advance(self.warm_task)
            step = record["step"]
            if not self.live and (step == 1 or step % 20 == 0 or step == self.warmup_steps):
                self.console.print(f"sft warm-up {step}/{self.warmup_steps}: nll {record.get('nll', float('nan')):.4f}")
        else:
            self.rows.append(record)
            if record["step"] > 0:
                if not self.stepped and record["step"] > 1:  # a resumed run: the steps before its first were done
                    self.progress.reset(self.rl_task, completed=record["step"] - 1)
                    self.progress.update(self.warm_task, visible=False)  # and it skips the warm-up
                self.stepped = True
                self.progress.advance(self.rl_task)
            if not self.live:
                parts = [f"{title} {_fmt(record, key, fmt)}" for title, key, fmt in COLUMNS if record.get(key) is not None]
                self.console.print(" | ".join(parts))
        if self.live:
            self.live.update(self._render())


def summary_table(summary: dict[str, Any], out_dir) -> Table:
    table = Table(title="summary", title_justify="left", show_header=False, show_edge=False)
    table.add_column("what")
    table.add_column("value")
    for k, v in summary.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    table.add_row("output", str(out_dir))
    return table
