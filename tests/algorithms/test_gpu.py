"""The algorithm paths that move tensors between devices (reference, critic, mismatch), on CUDA."""

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
    values = [(r["value_loss"], r["kl_ref"]) for r in steps]
    assert all(v >= 0 and kl >= 0 for v, kl in values), values  # both are >= 0 by construction (MSE; k3)
    assert all(abs(r["mismatch_kl"]) < 1e-2 for r in steps)  # GPU kernels differ between rollout and training


@pytest.mark.gpu
def test_gspo_on_cuda_bf16(tmp_path):
    summary, _ = run_tiny(tmp_path, "run.device=cuda", "run.num_rollout=3", "train.precision=bf16", "algorithm.policy_loss=gspo_token")
    assert summary["status"] == "completed"
