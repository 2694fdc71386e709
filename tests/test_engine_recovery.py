"""The issue's done-when test: a short `miles run` (the quickstart's tiny model, CPU) with
rollout.backend=sglang launching a `miles serve` engine, while a thread SIGKILLs the engine process
5 times. The run must complete, every step's batch must be whole (batch_size * n samples), no
sample may appear twice, and the 5 recoveries must be reported (per step and in the summary).

The run goes through :func:`miles_core.orchestration.run.run` -- what `miles run` calls -- in this
process, so that a plugin can see every step's samples (their ids) through ``miles_after_rollout``.
"""

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from miles_core.config.loader import load_config
from miles_core.hookspecs import hookimpl
from miles_core.orchestration.run import run
from miles_core.plugins.manager import MilesPlugins

BATCH, N, KILLS = 4, 4, 5


class Recorder:
    def __init__(self) -> None:
        self.steps: dict[int, list[tuple]] = {}

    @hookimpl
    def miles_after_rollout(self, ctx, step, samples):
        self.steps[step] = [(s.metadata["sample_id"], s.group_id, s.index, s.finish_reason, len(s.response_ids), s.metadata["attempts"])
                            for s in samples]


def engine_children() -> list[tuple[int, int]]:
    """(pid, port) of the `miles serve` processes this test process started."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me and b"serve" in cmd and b"--port" in cmd:
            out.append((int(d.name), int(cmd[cmd.index(b"--port") + 1])))
    return out


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
            return True
    except OSError:
        return False


def killer(done: threading.Event, kills: list[float]) -> None:
    """Kill the serving engine, wait for its replacement to serve, wait a little, kill again."""
    killed: set[int] = set()
    while len(kills) < KILLS and not done.is_set():
        live = [(pid, port) for pid, port in engine_children() if pid not in killed and healthy(port)]
        if not live:
            time.sleep(0.05)
            continue
        time.sleep(0.3)  # let it take requests
        pid = live[0][0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it exited on its own (the run is ending)
            return
        killed.add(pid)
        kills.append(time.monotonic())


@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_run_survives_five_engine_kills(tmp_path, transport):
    cfg = load_config(None, [
        "run.name=recovery", f"run.output_dir={tmp_path}", "run.num_rollout=40", "run.eval_every=100", "run.device=cpu",
        "run.num_threads=1", "data.task=reverse", "data.num_eval=8",
        "data.task_options={min_len: 2, max_len: 4, alphabet: abcde, demo_noise: 0.6}",
        "model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=384",
        f"rollout.batch_size={BATCH}", f"rollout.n_samples_per_prompt={N}", "rollout.max_response_len=6",
        "rollout.backend=sglang", "rollout.sglang.num_engines=1", f"sync.transport={transport}",
        "train.sft_warmup_steps=2", "train.sft_batch_size=16", "train.micro_batch_size=64",
    ])
    rec = Recorder()
    done, kills = threading.Event(), []
    thread = threading.Thread(target=killer, args=(done, kills), daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        summary = run(cfg, MilesPlugins(autoload=False, extra_plugins=[("recorder", rec)]), Console(file=open(os.devnull, "w")))
    finally:
        done.set()
        thread.join(5)
    wall = time.monotonic() - t0
    assert summary["status"] == "completed"
    assert len(kills) == KILLS, f"only {len(kills)} kills landed during the {wall:.0f} s run"
    assert sorted(rec.steps) == list(range(1, 41))
    all_ids = []
    for step, rows in rec.steps.items():
        assert len(rows) == BATCH * N, f"step {step}: {len(rows)} samples"
        assert [r[2] for r in rows] == list(range(BATCH * N))
        assert sorted(r[1] for r in rows) == sorted(g for g in range(BATCH) for _ in range(N))
        assert all(r[3] in ("stop", "length") and r[4] > 0 for r in rows)  # none lost or aborted
        all_ids += [(step, r[0]) for r in rows]
    assert len(set(all_ids)) == len(all_ids)
    records = [json.loads(line) for line in (Path(summary["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    restarts = sum(r.get("engine_restarts", 0) for r in records)
    assert summary["engine_restarts"] == KILLS and len(summary["recovery_s"]) == KILLS
    assert 0 < min(summary["recovery_s"]) and max(summary["recovery_s"]) < 60
    # the recoveries of the last step may be reported after its metrics were written (killed during eval/sync)
    assert KILLS - 1 <= restarts <= KILLS
    # The kills are timed by a thread, so where each lands (generation, sync, training) varies: on an
    # idle machine (2026-12-07) 5 of 5 kills cost /generate requests that were sent again with the disk
    # transport, 3 of 5 with the distributed one; under load a run once had none, so this is reported,
    # not asserted (the whole batches and unique ids above hold wherever the kills land).
    resent = sorted({(step, r[1]) for step, rows in rec.steps.items() for r in rows if r[5] > 1})
    print(f"run {wall:.1f} s, recovery_s {summary['recovery_s']}, (step, group) sent again: {resent}")
