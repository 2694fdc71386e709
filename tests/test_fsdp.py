"""FSDP2 with 2 CPU ranks (gloo, torchrun) gives the same loss curve as 1 rank on the same batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_trainer, tiny_decoder  # noqa: E402

WORKER = Path(__file__).with_name("fsdp_worker.py")
ROOT = WORKER.parents[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    return env


def _run(out: Path, ranks: int, *overrides: str) -> None:
    if ranks == 1:  # a plain process: this one
        from fsdp_worker import run

        run(out, list(overrides))
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(WORKER), str(out), *overrides]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_fsdp_two_ranks_match_one_rank(tmp_path):
    _run(tmp_path / "one", 1)
    # the 2-rank run also recomputes activations (FSDP2 + activation checkpointing together)
    _run(tmp_path / "two", 2, "train.activation_checkpointing=true")
    one = json.loads((tmp_path / "one" / "curve.json").read_text())
    two = json.loads((tmp_path / "two" / "curve.json").read_text())
    assert [c.pop("sharded") for c in one] == [False] * 3 and [c.pop("sharded") for c in two] == [True] * 3
    # fp32; only the reduction order differs (FSDP reduce-scatter, per-rank micro-batches)
    for a, b in zip(one, two):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a, b)
    assert one[0]["loss"] != one[2]["loss"]
    w1 = torch.load(tmp_path / "one" / "weights.pt")
    w2 = torch.load(tmp_path / "two" / "weights.pt")
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-5), k
    # the 2-rank sharded checkpoint loads into a single process (DCP reshards)
    trainer = make_trainer(tiny_decoder(seed=5), "train.max_tokens_per_micro_batch=24", "algorithm.kl_coef=0.1")
    trainer.load(tmp_path / "two" / "ckpt")
    assert trainer.step == 3
    for k, v in trainer.weights().items():
        assert torch.equal(v, w2[k]), k
