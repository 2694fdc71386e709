"""One-step-off (and, in local placement, async) vs synchronous schedule: time per RL step when rollout and training take similar time.

    python benchmarks/async_bench.py [--placement ray_disaggregated|local] [--steps 6] [key=value ...]

Default workload (CPU): a 4-layer, 256-wide decoder; 8 prompts x 4 samples, 48 new tokens; the
engine on one Ray actor and the trainer on another, one torch thread each (so the two phases run
on different cores and can overlap). Step 1 is left out of the means (nothing to overlap yet, and
warm-up). Prints a table; with env OUT set, writes OUT/async_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from miles_core.config.loader import load_config
from miles_core.orchestration.build import build
from miles_core.orchestration.loop import run_loop
from miles_core.plugins.manager import MilesPlugins

WORKLOAD = [
    "model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=512", "rollout.batch_size=8", "rollout.n_samples_per_prompt=4",
    "rollout.max_response_len=48", "rollout.temperature=1.0", "run.num_threads=1", "run.eval_every=1000",
    "data.num_eval=8", "orchestration.deterministic=true",
]


def measure(schedule: str, placement: str, steps: int, extra: list[str], out_dir: Path) -> dict:
    cfg = load_config(None, WORKLOAD + [f"run.num_rollout={steps}", f"run.output_dir={out_dir}",
                                        f"orchestration.schedule={schedule}", f"orchestration.placement={placement}", *extra])
    records = []
    run_loop(build(cfg, MilesPlugins(), None), records.append)
    rl = [r for r in records if r.get("phase") == "rl" and r["step"] > 1]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in rl)  # noqa: E731
    train = mean("time_logprobs") + mean("time_advantage") + mean("time_train")
    return {"schedule": schedule, "placement": placement, "time_step": mean("time_step"), "time_generate": mean("time_generate"),
            "time_train": train, "time_wait_rollout": mean("time_rollout"), "time_sync": mean("time_sync")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--placement", default="ray_disaggregated")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="miles-async-bench-"))
    schedules = ("sync", "one_step_off") + (("async",) if args.placement == "local" else ())
    rows = [measure(s, args.placement, args.steps, args.overrides, out_dir) for s in schedules]
    base = rows[0]["time_step"]
    print(f"placement {args.placement}, steps 2..{args.steps} (mean seconds)")
    print(f"{'schedule':<14}{'step':>8}{'generate':>10}{'train':>8}{'wait':>8}{'sync':>8}{'speedup':>9}")
    for r in rows:
        r["speedup"] = base / r["time_step"]
        print(f"{r['schedule']:<14}{r['time_step']:>8.2f}{r['time_generate']:>10.2f}{r['time_train']:>8.2f}"
              f"{r['time_wait_rollout']:>8.2f}{r['time_sync']:>8.2f}{r['speedup']:>8.2f}x")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "async_bench.json").write_text(json.dumps({"workload": WORKLOAD, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
