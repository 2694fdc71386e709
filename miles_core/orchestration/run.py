"""One `miles run`: plugins, config, components, the loop, and what it leaves in the output folder."""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from miles_core.config.schema import MilesConfig
from miles_core.models.checkpoint import atomic_file, save_hf_folder
from miles_core.observe.metrics import MetricsLog, strict_json
from miles_core.observe.plot import plot_curves
from miles_core.observe.view import LiveView, plugins_table, summary_table
from miles_core.orchestration.build import build, tokenizer_files
from miles_core.orchestration.checks import check_run_folders
from miles_core.orchestration.loop import run_loop
from miles_core.plugins.manager import MilesPlugins


def new_output_dir(cfg: MilesConfig) -> Path:
    base = Path(cfg.run.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = base / f"{cfg.run.name}-{stamp}"
    i = 1
    while out.exists():
        out = base / f"{cfg.run.name}-{stamp}-{i}"
        i += 1
    out.mkdir(parents=True)
    return out


def run(cfg: MilesConfig, plugins: MilesPlugins, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    console.print(plugins_table(plugins.info()))
    check_run_folders(cfg)  # before the run folder is made in run.output_dir
    out = new_output_dir(cfg)
    (out / "config.yaml").write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
    try:
        c = build(cfg, plugins, out)
    except BaseException:
        if [f.name for f in out.iterdir()] == ["config.yaml"]:  # refused before anything ran: no run folder left behind
            shutil.rmtree(out)
        raise
    console.print(
        f"[bold]run[/] {cfg.run.name}: task {cfg.data.task}, {cfg.algorithm.advantage_estimator} + "
        f"{cfg.algorithm.policy_loss}, reward {c.reward_name}, device {c.ctx.device}, "
        f"{sum(p.numel() for p in c.model.parameters()):,} parameters -> {out}"
    )
    log = MetricsLog(out / "metrics.jsonl")
    records: list[dict[str, Any]] = []

    def on_metrics(record: dict[str, Any]) -> None:
        records.append(record)
        log.write(record)
        view.update(record)

    try:
        sft = cfg.run.mode == "sft"  # its steps are SFT steps, and it has no warm-up
        with LiveView(console, cfg.run.num_rollout, 0 if sft else cfg.train.sft_warmup_steps, phase="sft" if sft else "rl") as view:
            summary, trainer = run_loop(c, on_metrics)
    finally:
        log.close()
        if records:
            plot_curves(records, out / "curves.png", title=f"{cfg.run.name}: {cfg.data.task}")
    summary.update(c.ctx.extras.get("summary", {}))  # what components report about the run (engine restarts...)
    if cfg.run.save and trainer is not None:
        dest = Path(cfg.run.save) / "hf"
        export = getattr(trainer, "export_hf", None)
        if export is not None:
            export(c.family, dest, tokenizer_files(c.ctx.tokenizer))
        else:
            save_hf_folder(trainer.model, c.family, dest, tokenizer_files(c.ctx.tokenizer))
        summary["saved"] = str(dest)
    summary["output_dir"] = str(out)
    atomic_file(out / "summary.json", lambda tmp: tmp.write_text(strict_json(summary, indent=2)))
    console.print(summary_table({k: v for k, v in summary.items() if k != "output_dir"}, out))
    return summary
