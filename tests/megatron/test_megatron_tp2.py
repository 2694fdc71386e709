"""tensor_parallel=2 on two CPU ranks (torchrun, gloo) gives the single-process torch trainer's numbers."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_helpers import batch
from test_megatron_trainer import FP32, KERNELS, _config, _decoder, off_policy

from miles_core.algorithms.losses import ppo_clip
from miles_core.train.torch_trainer import TorchTrainer

HERE = Path(__file__).parent


def test_tensor_parallel_2_matches_torch_trainer(tmp_path):
    out = tmp_path / "tp2.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "megatron_tp2_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)

    torch.set_num_threads(1)
    cfg = _config("token_mean")
    ref = TorchTrainer(_decoder(True, False), cfg, torch.device("cpu"), FP32, KERNELS)
    b = batch()
    lp = ref.compute_logprobs(b)
    b.old_logprobs = off_policy(lp, b)
    metrics = ref.train_step(b, functools.partial(ppo_clip, cfg=cfg.algorithm))

    assert got["shard_rows"] == 31  # 61 tokens padded to 62, half on each rank
    assert lp.abs().max() > 1.0
    torch.testing.assert_close(got["logprobs"], lp, atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm", "entropy", "clip_frac"):
        assert got["metrics"][key] == pytest.approx(metrics[key], abs=1e-5, rel=1e-5), key
    for name, p in ref.model.named_parameters():  # the clipped gradients, gathered over both ranks
        torch.testing.assert_close(got["grads"][name], p.grad, atol=1e-6, rtol=1e-4, msg=lambda m: f"grad {name}: {m}")
    weights = ref.weights()
    assert set(got["weights"]) == set(weights)
    # Adam's first step is ~lr * g/|g|: where |g| is tiny, the grads' agreement (1e-6 above) says
    # nothing about the step (an element with |g| ~ 1e-6 moved 5.4e-4 apart on 2026-12-04's CI
    # machine). Elements with |g| > 1e-4 must agree to 5% of one step at lr 1e-2; the rest to within
    # one full step each way (2 lr), i.e. still an Adam step of the same weights.
    grads = dict(ref.model.named_parameters())
    lr = cfg.train.lr
    firm_count = 0
    for k, w in weights.items():
        g = grads[k].grad
        firm = g.abs() > 1e-4
        firm_count += int(firm.sum())
        torch.testing.assert_close(got["weights"][k][firm], w[firm], atol=5e-4, rtol=0, msg=lambda m: f"{k}: {m}")
        assert (got["weights"][k] - w).abs().max() <= 2 * lr + 1e-6, k
    assert firm_count > 0.5 * sum(int((grads[k].grad != 0).sum()) for k in weights)  # most updated elements checked tightly
