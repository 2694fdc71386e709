"""The algorithm paths that move tensors between devices (reference, critic, mismatch), on CUDA."""

import math

import pytest

from test_e2e import BASE, rl_steps, run_tiny


@pytest.mark.gpu
def test_ppo_with_reference_kl_and_tis_on_cuda(tmp_path):
    summary, records = run_tiny(
        tmp_path, "run.device=cuda", "run.num_rollout=4", "algorithm.advantage_estimator=ppo",
        "algorithm.kl_coef=0.05", "algorithm.mismatch_correction=tis", "algorithm.dynamic_sampling=true",
    )
    assert summary["status"] == "completed"
    steps = rl_steps(records)
    # the reference is the policy as RL starts, copied to the GPU (0 KL at the first step), and it
    # stays behind as the policy moves (a reference that shared the policy's weights would stay at 0)
    assert steps[0]["kl_ref"] < 1e-6 < steps[-1]["kl_ref"], [r["kl_ref"] for r in steps]
    assert all(math.isfinite(r["value_loss"]) and r["grad_norm"] > 0 for r in steps), steps
    assert all(abs(r["mismatch_kl"]) < 1e-2 for r in steps)  # GPU kernels differ between rollout and training


@pytest.mark.gpu
def test_gspo_on_cuda_bf16(tmp_path):
    summary, records = run_tiny(tmp_path, "run.device=cuda", "run.num_rollout=3", "train.precision=bf16", "algorithm.policy_loss=gspo_token")
    assert summary["status"] == "completed"
    steps = rl_steps(records)
    assert len(steps) == 3 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in steps), steps
