"""How much the CPU end-to-end tests' learning depends on the seed.

`tests/algorithms/test_e2e.py` asserts that each RL recipe answers at least 5 more of 100 held-out
strings after 25 steps than after the warm-up, on seed 0. This runs the same recipes on other
seeds and prints each gain, so the margin of that threshold is a measured spread, not one
trajectory.

    python benchmarks/learning_seeds.py --seeds 0,1,2,3 [--cases grpo,gspo] [--jobs 2] [--set train.updates_per_rollout=2]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "algorithms")]  # this checkout's miles_core

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from test_e2e import NUM_EVAL, RL_CASES, run_tiny  # noqa: E402

# the e2e test's PPO case (its own test, with a +-1 reward for the critic) next to RL_CASES
CASES = {**RL_CASES, "ppo": ["algorithm.advantage_estimator=ppo", "reward.name=e2e_rewards:signed"]}


def one(case: str, seed: int, extra: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory() as d:
        summary, _ = run_tiny(Path(d), *CASES[case], *extra, f"run.seed={seed}")
    first, last = summary["eval_accuracy_first"], summary["eval_accuracy_last"]
    return {"case": case, "seed": seed, "first": first, "last": last, "gain": round((last - first) * NUM_EVAL)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes; each uses one thread)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override added to every case")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown --cases {unknown}; known: {list(CASES)}")
    jobs = [(c, s) for c in cases for s in seeds]
    rows = []
    with Progress(console=Console(stderr=True)) as progress, cf.ProcessPoolExecutor(args.jobs) as pool:
        task = progress.add_task("runs", total=len(jobs))
        for fut in cf.as_completed([pool.submit(one, c, s, tuple(args.set)) for c, s in jobs]):
            rows.append(fut.result())
            progress.advance(task)
    rows.sort(key=lambda r: (cases.index(r["case"]), r["seed"]))
    title = f"held-out gain (of {NUM_EVAL}) after 25 RL steps, by run.seed (the test: >= 5 on seed 0)"
    table = Table(title=title + "".join(f"; {kv}" for kv in args.set))
    table.add_column("case", no_wrap=True)
    for s in seeds:
        table.add_column(str(s), justify="right")
    table.add_column("min", justify="right")
    for c in cases:
        gains = [r["gain"] for r in rows if r["case"] == c]
        table.add_row(c, *[str(g) for g in gains], str(min(gains)))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
