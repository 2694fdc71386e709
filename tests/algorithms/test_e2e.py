"""Seeded end-to-end runs on CPU: every RL estimator (and distillation) raises held-out accuracy.

Setup: string reversal (2-4 letters of "abcde", 100 strings held out), a 2-layer 128-wide decoder,
a warm-up on a flawed teacher that copies half of the time, then 25 RL steps of 32 prompts x 8 samples. Each run takes ~15-25 s on one
thread; the numbers are deterministic for a seed. A gain is counted in held-out strings (of 100).
"""

import io
import itertools
import json
import random
from pathlib import Path

import pytest
from rich.console import Console

from miles_core.config.loader import load_config
from miles_core.data.synthetic import ReverseTask
from miles_core.observe.metrics import read_metrics
from miles_core.orchestration.run import run
from miles_core.plugins.manager import MilesPlugins

MODEL = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=384"]
# The quickstart's task, smaller: reverse 2-4 letters of "abcde" after a warm-up on a flawed teacher
# (half of its demonstrations copy instead of reversing), so RL has a behaviour to discover that
# generalises to the held-out strings.
BASE = [
    "run.num_threads=1", "run.eval_every=100", "run.num_rollout=25",
    "data.task=reverse", "data.task_options={min_len: 2, max_len: 4, alphabet: abcde, demo_noise: 0.5}", "data.num_eval=100", *MODEL,
    "rollout.batch_size=32", "rollout.n_samples_per_prompt=8", "rollout.max_response_len=5",
    "train.sft_warmup_steps=120", "train.sft_batch_size=32", "train.sft_lr=0.003", "train.lr=0.002", "train.micro_batch_size=256",
]
NUM_EVAL = 100


def run_tiny(tmp_path: Path, *overrides: str, base=BASE) -> tuple[dict, list[dict]]:
    cfg = load_config(None, [*base, f"run.output_dir={tmp_path / 'runs'}", *overrides])
    summary = run(cfg, MilesPlugins(autoload=False), Console(file=io.StringIO()))
    return summary, read_metrics(Path(summary["output_dir"]) / "metrics.jsonl")


def assert_gain(summary, problems: int = 5, num_eval: int = NUM_EVAL) -> None:
    """At least ``problems`` more of the held-out problems answered right at the end than at the start."""
    gained = round((summary["eval_accuracy_last"] - summary["eval_accuracy_first"]) * num_eval)
    assert gained >= problems, summary


def rl_steps(records):
    return [r for r in records if r["phase"] == "rl" and r["step"] > 0]


RL_CASES = {
    "grpo": [],
    "dr_grpo": ["algorithm.normalize_std=false", "algorithm.loss_agg=seq_sum"],
    "rloo_kl_loss_entropy_dual_clip": ["algorithm.advantage_estimator=rloo", "algorithm.kl_coef=0.05", "algorithm.kl_estimator=k3_clamped",
                                       "algorithm.entropy_coef=0.001", "algorithm.clip_c=3"],
    "reinforce_pp_kl_reward": ["algorithm.advantage_estimator=reinforce_plus_plus", "algorithm.kl_coef=0.05", "algorithm.kl_mode=reward"],
    "reinforce_pp_baseline": ["algorithm.advantage_estimator=reinforce_plus_plus_baseline"],
    "gspo": ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq_mean_token_mean"],
    "gspo_token_tis": ["algorithm.policy_loss=gspo_token", "algorithm.mismatch_correction=tis"],
    "dapo": ["algorithm.dynamic_sampling=true", "algorithm.eps_clip_high=0.28", "algorithm.overlong_buffer=1",
             "rollout.max_response_len=6"],  # answers of <= 5 tokens (4 letters + eos) are not penalised,
}


@pytest.mark.parametrize("name", list(RL_CASES))
def test_rl_raises_heldout_accuracy(tmp_path, name):
    summary, records = run_tiny(tmp_path, *RL_CASES[name])
    assert summary["status"] == "completed"
    assert_gain(summary)
    steps = rl_steps(records)
    for key in ("clip_frac", "approx_kl", "entropy", "adv_mean", "adv_std", "mismatch_kl"):
        assert key in steps[-1], key
    assert all(abs(r["mismatch_kl"]) < 1e-4 for r in steps)  # engine and trainer share one model on CPU
    if "algorithm.kl_coef=0.05" in RL_CASES[name]:
        assert steps[0]["kl_ref"] < 1e-6 < steps[-1]["kl_ref"]  # the reference is the policy as RL starts
    if name == "dapo":
        assert all(r["dynamic_sampling_kept_groups"] == 32 for r in steps)
        assert sum(r["dynamic_sampling_rounds"] for r in steps) > 0


def test_ppo_raises_accuracy_and_value_loss_falls(tmp_path):
    summary, records = run_tiny(tmp_path, "algorithm.advantage_estimator=ppo", "reward.name=e2e_rewards:signed")
    assert_gain(summary)
    steps = rl_steps(records)
    losses = [r["value_loss"] for r in steps]
    ev = [r["value_explained_var"] for r in steps]
    # it falls, then rises back as accuracy nears 0.5: the variance of +-1 returns, 4p(1-p), peaks
    # there (from 0.56 at the first step to ~1 at the last, with torch 2.13), so the late loss is
    # not comparable with the first. The explained variance of the returns does not move with that
    # variance, and it rises.
    assert min(losses) < 0.7 * losses[0], losses
    assert sum(ev[-5:]) / 5 > sum(ev[:3]) / 3 + 0.1, ev


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """SFT from JSONL (prompt, response) pairs of correct reversals; the held-out strings stay out.

    Its saved model is the teacher of the distillation tests."""
    tmp = tmp_path_factory.mktemp("sft")
    task = ReverseTask(num_eval=NUM_EVAL, min_len=2, max_len=4, alphabet="abcde")
    train = list(itertools.islice(task.train_prompts(random.Random(1)), 2000))
    (tmp / "train.jsonl").write_text("\n".join(json.dumps({"prompt": p.text, "response": p.label}) for p in train))
    (tmp / "eval.jsonl").write_text("\n".join(json.dumps({"prompt": p.text, "label": p.label}) for p in task.eval_prompts()))
    summary, records = run_tiny(
        tmp, "run.mode=sft", "run.num_rollout=150", "run.eval_every=75", f"run.save={tmp / 'teacher'}",
        "data.task=jsonl", f"data.train_path={tmp / 'train.jsonl'}", f"data.eval_path={tmp / 'eval.jsonl'}",
        "data.task_options={}",
    )
    return summary, records, tmp / "teacher" / "hf"


def test_sft_lowers_loss_and_raises_accuracy(sft_run):
    summary, records, teacher = sft_run
    assert summary["train_nll_last"] < 0.5 * summary["train_nll_first"], summary
    assert summary["eval_nll_last"] < 0.5 * summary["eval_nll_first"], summary
    assert_gain(summary, 8)
    assert (teacher / "model.safetensors").is_file()


@pytest.mark.parametrize("mode", [["algorithm.advantage_estimator=distill"], ["algorithm.distill_coef=0.5"]], ids=["alone", "added_to_grpo"])
def test_on_policy_distillation_raises_accuracy(tmp_path, sft_run, mode):
    teacher = sft_run[2]
    summary, records = run_tiny(tmp_path, *mode, f"algorithm.teacher_checkpoint={teacher}")
    assert_gain(summary)
    kls = [r["distill_reverse_kl"] for r in rl_steps(records)]
    assert sum(kls[-5:]) < sum(kls[:5]), kls  # the student moves towards the teacher
