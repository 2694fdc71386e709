"""benchmarks/vs_trl.py keeps a framework's crash as a row of the comparison (TRL stopped at step 2 with a
CUDA device-side assert in 2 of 6 H200 seeds, 2026-12-03), so the other framework's row and the JSON survive."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_crashed_run_becomes_a_row_with_its_steps(tmp_path, monkeypatch, capsys):
    vs = _vs_trl()
    timing: dict = {}

    def crashing_run():  # stands in for TRL: two steps, then the failure
        timing.update(step_s=[20.5, 3.7], gen_s=[], gen_tokens=[])
        raise RuntimeError("CUDA error: device-side assert triggered\nmore detail")

    crashed = vs.attempt("TRL GRPOTrainer", crashing_run, 100.0, timing)
    assert crashed == {"framework": "TRL GRPOTrainer", "failed": "RuntimeError: CUDA error: device-side assert triggered",
                       "steps_completed": 2}
    done = {"step_s": [2.0, 1.0, 1.0], "gen_s": [1.0, 0.5, 0.5], "gen_tokens": [100, 50, 50], "peak_bytes": 2**30,
            "acc_before": 0.155, "acc_after": 0.47}
    ok = vs.attempt("Miles", lambda: done, 100.0)
    assert ok["s_per_step"] == 1.0 and ok["acc_after"] == 0.47 and "failed" not in ok

    monkeypatch.setenv("OUT", str(tmp_path))
    cfg = SimpleNamespace(rollout=SimpleNamespace(batch_size=32, n_samples_per_prompt=8, max_response_len=128),
                          run=SimpleNamespace(num_rollout=3, device="cuda"), train=SimpleNamespace(lr=2e-5),
                          data=SimpleNamespace(task_options={"dataset": "basic_arithmetic"}))
    vs.report(cfg, SimpleNamespace(miles_set=[], tag="_t"), [ok, crashed], 200)
    out = capsys.readouterr().out
    assert "failed after 2 steps" in out and "TRL s/step / Miles s/step" not in out
    rows = json.loads((tmp_path / "vs_trl_t.json").read_text())["rows"]
    assert rows[1]["failed"].startswith("RuntimeError") and rows[0]["acc_after"] == 0.47
