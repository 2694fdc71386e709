"""The RL loop end to end on a tiny config: outputs, hooks, weight versions, data sources, rewards."""

import json
import math
from collections import Counter

import pytest
import torch

from miles_core.config.loader import load_config
from miles_core.hookspecs import hookimpl
from miles_core.observe.metrics import read_metrics
from miles_core.orchestration.build import build
from miles_core.orchestration.loop import run_loop
from miles_core.orchestration.run import run
from miles_core.plugins.manager import MilesPlugins
from miles_core.testing.contracts import tiny_config


class Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def miles_run_start(self, ctx):
        self.calls.append(("start",))

    @hookimpl
    def miles_after_rollout(self, ctx, step, samples):
        self.calls.append(("rollout", step, len(samples), {s.weight_version for s in samples}))

    @hookimpl
    def miles_after_train_step(self, ctx, step, metrics):
        self.calls.append(("train", step, "loss" in metrics))

    @hookimpl
    def miles_after_weight_sync(self, ctx, version):
        self.calls.append(("sync", version))

    @hookimpl
    def miles_run_end(self, ctx, summary):
        self.calls.append(("end", summary["status"]))


def test_hooks_fire_in_order_with_versions(tmp_path):
    cfg = tiny_config(tmp_path, "train.sft_warmup_steps=2")
    rec = Recorder()
    pm = MilesPlugins(autoload=False, extra_plugins=[("recorder", rec)])
    summary, trainer = run_loop(build(cfg, pm, tmp_path), lambda r: None)
    assert summary["status"] == "completed" and summary["weight_version"] == 3
    assert rec.calls == [
        ("start",),
        ("sync", 1),  # after the warm-up
        ("rollout", 1, 8, {1}),
        ("train", 1, True),
        ("sync", 2),
        ("rollout", 2, 8, {2}),
        ("train", 2, True),
        ("sync", 3),
        ("end", "completed"),
    ]


def test_run_writes_metrics_png_and_summary(tmp_path):
    cfg = tiny_config(tmp_path, "run.num_rollout=3", "run.eval_every=2", f"run.save={tmp_path / 'final'}")
    summary = run(cfg, MilesPlugins(autoload=False))
    out = tmp_path / "runs"
    (run_dir,) = list(out.iterdir())
    records = read_metrics(run_dir / "metrics.jsonl")
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    assert [r["step"] for r in rl if "eval_accuracy" in r] == [0, 2, 3]
    for r in rl[1:]:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["rollout_tok_s"] > 0 and r["time_rollout"] > 0
        assert r["weight_version"] == r["step"]
        assert r["mismatch_abs"] < 1e-4  # the engine and the trainer share one model: on-policy
    png = (run_dir / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert (tmp_path / "final" / "hf" / "model.safetensors").is_file()
    assert summary["eval_accuracy_first"] == rl[0]["eval_accuracy"]


def test_jsonl_source_with_custom_keys_and_custom_reward(tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    rows = [{"question": f"{w}?", "answer": w[::-1], "id": i} for i, w in enumerate(["ab", "abc", "ba", "cab", "bca", "aab"])]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "my_reward.py").write_text(
        "calls = []\n"
        "def score(sample):\n"
        "    calls.append(sample.metadata['id'])\n"
        "    return float(sample.response.startswith(sample.label[:1]))\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(
        tmp_path, "data.task=jsonl", f"data.train_path={data}", f"data.eval_path={data}",
        "data.prompt_key=question", "data.label_key=answer", "reward.name=my_reward:score",
    )
    c = build(cfg, MilesPlugins(autoload=False), tmp_path)
    assert [p.text for p in c.task.eval_prompts()] == [r["question"] for r in rows]
    summary, _ = run_loop(c, lambda r: None)
    import my_reward

    # 2 steps x 4 prompts x 2 samples, plus 3 evals x 6 prompts
    assert len(my_reward.calls) == 2 * 4 * 2 + 3 * 6
    assert set(my_reward.calls) <= set(range(6))


def test_async_reward_with_timeout(tmp_path):
    import asyncio

    import pytest

    from miles_core.rewards.runner import RewardError, score_samples
    from miles_core.types import Sample

    async def slow(sample):
        await asyncio.sleep(5)
        return 1.0

    async def fast(sample):
        return 0.5

    s = [Sample("p", [1], [2], "x", [0.0])]
    assert score_samples(fast, "fast", s, 1.0) == [0.5] and s[0].reward == 0.5
    with pytest.raises(RewardError, match="reward 'slow' timed out after 0.05s"):
        score_samples(slow, "slow", s, 0.05)
    with pytest.raises(RewardError, match="returned 'yes'"):
        score_samples(lambda x: "yes", "bad", s, 1.0)
    for value in (float("nan"), float("inf"), True):
        with pytest.raises(RewardError, match=f"reward 'odd' returned {value!r} for sample 0; it must return a finite number"):
            score_samples(lambda x, v=value: v, "odd", s, 1.0)

    def broken(sample):
        return {}["label"]

    with pytest.raises(RewardError, match=r"reward 'broken' raised KeyError: 'label' \(sample 0, prompt 'p'\)"):
        score_samples(broken, "broken", s, 1.0)


def test_micro_batching_gives_the_same_update(tmp_path):
    """Gradient accumulation is exact: micro-batch size does not change the step."""
    results = []
    for mbs in (8, 3):
        cfg = tiny_config(tmp_path, f"train.micro_batch_size={mbs}", "run.num_rollout=1")
        c = build(cfg, MilesPlugins(autoload=False), tmp_path)
        _, trainer = run_loop(c, lambda r: None)
        results.append({k: v.clone() for k, v in trainer.weights().items()})
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-5, atol=1e-6)


def spy_on_trainer(c, method: str, seen) -> None:
    """Make the trainer that ``run_loop`` builds from ``c`` report each ``method`` call as ``seen(args, result)``."""
    make = c.trainer_factory

    def factory(*args, **kwargs):
        trainer = make(*args, **kwargs)
        inner = getattr(trainer, method)

        def spied(*a, **kw):
            out = inner(*a, **kw)
            seen(a, out)
            return out

        setattr(trainer, method, spied)
        return trainer

    c.trainer_factory = factory


def test_on_policy_old_logprobs_from_the_training_forward(tmp_path):
    """train.old_logprobs=auto skips the separate old-policy pass; the updates, losses and mismatch
    metrics are those of train.old_logprobs=recompute."""
    runs, passes = {}, Counter()  # the trainer's logprob passes, by mode
    for mode in ("auto", "recompute"):
        cfg = tiny_config(tmp_path / mode, f"train.old_logprobs={mode}", "run.num_rollout=2")
        records, c = [], build(cfg, MilesPlugins(autoload=False), tmp_path / mode)
        spy_on_trainer(c, "compute_logprobs", lambda args, out, mode=mode: passes.update([mode]))
        _, trainer = run_loop(c, records.append)
        rl = [r for r in records if r.get("phase") == "rl" and r["step"] > 0]
        runs[mode] = (rl, {k: v.clone() for k, v in trainer.weights().items()})
    assert passes["recompute"] - passes["auto"] == 2  # one old-policy pass per RL step, skipped by auto
    (auto, w_auto), (full, w_full) = runs["auto"], runs["recompute"]
    assert len(auto) == len(full) == 2
    for a, b in zip(auto, full):
        for key in ("loss", "grad_norm", "reward_mean", "mismatch_kl", "mismatch_k1", "mismatch_abs"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])), (key, a[key], b[key])
    for k in w_auto:
        torch.testing.assert_close(w_auto[k], w_full[k], rtol=1e-5, atol=1e-6)


def _dense_reward(tmp_path, monkeypatch) -> None:
    """reward.name=dense_reward:digit_share: the share of digits in the response, a reward that varies within groups."""
    (tmp_path / "dense_reward.py").write_text(
        "def digit_share(sample):\n    return sum(ch.isdigit() for ch in sample.response) / max(len(sample.response), 1)\n")
    monkeypatch.chdir(tmp_path)


def test_several_updates_per_rollout_are_off_policy_after_the_first(tmp_path, monkeypatch):
    """train.updates_per_rollout=2 splits each step's batch into two disjoint halves, one optimizer step each; the
    old logprobs are the rollout policy's for both, so the first half trains on-policy (approx KL 0) and the
    second, after one update, off-policy (approx KL > 0, the PPO ratio at work), with old_logprobs=auto as well."""
    _dense_reward(tmp_path, monkeypatch)  # every group has nonzero advantages
    cfg = tiny_config(tmp_path, "train.updates_per_rollout=2", "train.old_logprobs=auto", "run.num_rollout=2", "train.lr=0.01",
                      "rollout.temperature=1.0", "rollout.max_response_len=6", "reward.name=dense_reward:digit_share")
    c = build(cfg, MilesPlugins(autoload=False), tmp_path)
    parts = []
    spy_on_trainer(c, "train_step", lambda args, out: parts.append((args[0].num_samples, out["approx_kl"])))
    records = []
    run_loop(c, records.append)
    rl = [r for r in records if r.get("phase") == "rl" and r["step"] > 0]
    per_step = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    rl_parts = parts[-2 * len(rl):]  # the RL steps' parts (any SFT warm-up comes first)
    assert len(rl) == 2 and len(rl_parts) == 4
    for first, second in zip(rl_parts[::2], rl_parts[1::2]):
        assert first[0] + second[0] == per_step and first[0] == second[0]
        assert abs(first[1]) < 1e-6  # the rollout policy itself
        assert second[1] > 1e-6  # one update later


def test_updates_per_rollout_takes_that_many_even_steps(tmp_path):
    """train.updates_per_rollout=5 over a step's 8 samples: five optimizer steps on parts of 2, 2, 2, 1, 1 samples (was:
    torch.chunk's parts of 2, four steps, so the run took fewer updates than configured and its LR schedule, counted
    in num_rollout * updates_per_rollout steps, never reached its end)."""
    cfg = tiny_config(tmp_path, "train.updates_per_rollout=5", "run.num_rollout=2", "train.lr_decay=cosine")
    c = build(cfg, MilesPlugins(autoload=False), tmp_path)
    parts = []
    spy_on_trainer(c, "train_step", lambda args, out: parts.append((args[0].num_samples, out["lr"])))
    _, trainer = run_loop(c, lambda r: None)
    assert cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt == 8
    rl_parts = parts[-10:]
    assert [n for n, _ in rl_parts] == [2, 2, 2, 1, 1] * 2
    assert trainer.step == trainer.total_steps == 10
    lr = cfg.train.lr
    assert rl_parts[-1][1] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * 9 / 10)))  # the schedule's last step


def test_metrics_log_writes_strict_json_and_appends(tmp_path):
    from miles_core.observe.metrics import MetricsLog

    path = tmp_path / "sub" / "metrics.jsonl"
    log = MetricsLog(path)
    log.write({"step": 1, "loss": float("nan"), "kl": float("inf"), "reward": 0.5})
    log.close()
    # non-finite floats become null: the file stays strict JSON (json.loads would accept NaN, other readers do not)
    assert path.read_text().splitlines()[0] == '{"step": 1, "loss": null, "kl": null, "reward": 0.5}'
    with path.open("a") as fh:
        fh.write("\n")  # a blank line (e.g. a run killed mid-write and resumed) is skipped
    log = MetricsLog(path)  # a resumed run appends
    log.write({"step": 2})
    log.close()
    assert read_metrics(path) == [{"step": 1, "loss": None, "kl": None, "reward": 0.5}, {"step": 2}]


def test_reward_errors_of_the_user_pass_through_and_bad_reward_fns_are_refused():
    import pytest

    from miles_core.errors import ConfigError
    from miles_core.rewards.custom import check_reward_fn
    from miles_core.rewards.runner import score_samples
    from miles_core.types import Sample

    def strict(sample):
        raise ConfigError("set reward.threshold")

    with pytest.raises(ConfigError, match="^set reward.threshold$"):  # not wrapped as "raised ConfigError"
        score_samples(strict, "strict", [Sample("p", [1], [2], "x", [0.0])], 1.0)
    with pytest.raises(ConfigError, match="reward 'x:y' is not callable"):
        check_reward_fn(3, "x:y")
    with pytest.raises(ConfigError, match=r"reward 'x:two' must accept one argument, the sample; its signature is \(a, b\)"):
        check_reward_fn(lambda a, b: 0.0, "x:two")
    ok = lambda sample, scale=1.0: scale  # noqa: E731
    assert check_reward_fn(ok, "x:ok") is ok


def test_a_prompt_served_twice_gets_its_own_seed_and_step_each_time(tmp_path):
    """A JSONL file of 3 rows serves the same Prompt object again each epoch, twice in one batch of 4
    when an epoch ends inside it: each use must be its own request (deterministic seed, step)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": w, "label": w[::-1]}) + "\n" for w in ["abc", "bcd", "cde"]))
    cfg = tiny_config(tmp_path, "data.task=jsonl", f"data.train_path={data}", f"data.eval_path={data}",
                      "orchestration.deterministic=true", "rollout.max_response_len=6")
    groups = []

    class Spy:
        @hookimpl
        def miles_after_rollout(self, ctx, step, samples):
            groups.extend((step, s.prompt, s.metadata["step"], s.metadata["sampling_seed"]) for s in samples[::2])

    run_loop(build(cfg, MilesPlugins(autoload=False, extra_plugins=[("spy", Spy())]), tmp_path), lambda r: None)
    assert len(groups) == 8 and all(step == meta_step for step, _, meta_step, _ in groups)
    seeds = [seed for *_, seed in groups]
    assert len(set(seeds)) == 8  # 8 prompt uses over 2 steps, 8 seeds
    assert len({p for _, p, *_ in groups}) == 3 and Counter(p for _, p, *_ in groups).most_common(1)[0][1] >= 3


def test_a_reward_may_be_any_real_number_numpy_s_included():
    """np.float32 / np.int64 are not float / int subclasses; a verifier computing with numpy returns them."""
    import numpy as np
    import pytest

    from miles_core.rewards.runner import RewardError, score_samples
    from miles_core.testing.contracts import check_reward
    from miles_core.types import Sample

    s = [Sample("p", [1], [2], "x", [0.0]), Sample("p", [1], [3], "y", [0.0], index=1)]
    for value, want in ((np.float32(0.25), 0.25), (np.int64(3), 3.0), (np.float64(-0.5), -0.5), (2, 2.0)):
        assert score_samples(lambda x, v=value: v, "np", s, 1.0) == [want, want]
        assert type(s[0].reward) is float and s[1].reward == want
        check_reward(lambda x, v=value: v, "np")
    for value in (np.bool_(True), np.float32("nan"), torch.tensor(1.0)):
        with pytest.raises(RewardError, match="it must return a finite number"):
            score_samples(lambda x, v=value: v, "odd", s, 1.0)


def test_prompts_without_reference_answers_for_sft(tmp_path):
    """JSONL rows without a label have no reference answer. The SFT warm-up on them is refused with one line
    (it failed with "max() arg is an empty sequence"); run.mode=sft evaluates such held-out prompts without
    eval_nll (it failed the same way) and trains on its own data.train_path examples."""
    import pytest

    from miles_core.errors import DataError

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ["abc", "bcd", "cde"]))
    cfg = tiny_config(tmp_path, "data.task=jsonl", f"data.train_path={prompts}", f"data.eval_path={prompts}",
                      "train.sft_warmup_steps=2", "train.sft_batch_size=4")
    with pytest.raises(DataError, match=r"^train.sft_warmup_steps trains on the task's reference answers: "
                                        r"task 'jsonl' has none for the 4 prompts of warm-up step 1 \(JSONL: data.label_key\)$"):
        run_loop(build(cfg, MilesPlugins(autoload=False), tmp_path), lambda r: None)

    examples = tmp_path / "sft.jsonl"
    examples.write_text("".join(json.dumps({"prompt": w, "response": w[::-1]}) + "\n" for w in ["abc", "bcd", "cde"]))
    cfg = tiny_config(tmp_path, "run.mode=sft", "data.task=jsonl", f"data.train_path={examples}", f"data.eval_path={prompts}")
    records = []
    summary, _ = run_loop(build(cfg, MilesPlugins(autoload=False), tmp_path), records.append)
    assert [r["step"] for r in records] == [0, 1, 2] and all("eval_accuracy" in r and "eval_nll" not in r for r in records)
    assert summary["eval_nll_first"] is None and summary["train_nll_last"] > 0


def test_a_run_start_or_run_end_hook_that_raises_still_closes_the_engines(tmp_path, monkeypatch):
    """run_start ran before the try whose finally closes the placement (engines, launched servers, Ray actors),
    and run_end before the close in that finally: a plugin failing in either left them running (and after a
    failed run_start, miles_run_end was never called)."""
    import pytest

    import miles_core.orchestration.loop as loop
    from miles_core.errors import PluginError

    class FailsAtStart:
        @hookimpl
        def miles_run_start(self, ctx):
            raise RuntimeError("tracker is down")

    class FailsAtEnd:
        @hookimpl
        def miles_run_end(self, ctx, summary):
            raise RuntimeError("upload failed")

    closed = []
    make = loop.make_placement

    def recording(c):
        placement = make(c)
        close = placement.close
        placement.close = lambda: (closed.append(True), close())
        return placement

    monkeypatch.setattr(loop, "make_placement", recording)
    for plugin, hook, status in [(FailsAtStart(), "miles_run_start", "failed"), (FailsAtEnd(), "miles_run_end", "completed")]:
        closed.clear()
        rec = Recorder()
        pm = MilesPlugins(autoload=False, extra_plugins=[("failing", plugin), ("rec", rec)])
        c = build(tiny_config(tmp_path, "run.num_threads=1"), pm, tmp_path)
        with pytest.raises(PluginError, match=f"'failing'.*{hook}"):
            run_loop(c, lambda record: None)
        assert closed == [True] and rec.calls[-1] == ("end", status)


def test_a_run_end_hook_that_raises_does_not_hide_why_the_run_failed(tmp_path, caplog):
    """A run that failed (here a plugin's after_rollout) calls miles_run_end from its finally; a run_end that raised
    there too (a tracker's upload, a summary key a failed run lacks) replaced the run's own error, so the CLI's one
    line named run_end and the real failure was never shown. The run's error goes on; run_end's is logged."""
    from miles_core.errors import PluginError

    class FailsInRollout:
        @hookimpl
        def miles_after_rollout(self, ctx, step, samples):
            raise KeyError("samples_table")

    class FailsAtEnd:
        @hookimpl
        def miles_run_end(self, ctx, summary):
            raise KeyError(summary["eval_accuracy_last"])  # a failed run's summary has only its status

    pm = MilesPlugins(autoload=False, extra_plugins=[("table", FailsInRollout()), ("tracker", FailsAtEnd())])
    c = build(tiny_config(tmp_path, "run.num_threads=1"), pm, tmp_path)
    with pytest.raises(PluginError, match="'table'.*samples_table.*miles_after_rollout"):
        run_loop(c, lambda record: None)
    assert any("'tracker'" in r.getMessage() and "miles_run_end" in r.getMessage() for r in caplog.records)


def test_an_estimator_that_needs_old_logprobs_gets_them(tmp_path):
    """By default the trainer's training forward stands in for the old-policy logprobs, so the estimator saw
    old_logprobs=None; one that reads them (needs_old_logprobs = True) failed every run at its first step."""
    from miles_core.types import AdvantageOutputs

    seen = []

    def surprise(inputs, cfg):
        seen.append(inputs.old_logprobs is not None)
        return AdvantageOutputs((inputs.rewards[:, None] - 0.01 * inputs.old_logprobs) * inputs.response_mask)

    surprise.needs_old_logprobs = True

    class Surprise:
        @hookimpl
        def miles_register_advantage_estimators(self, registry):
            registry.add("surprise", surprise)

    pm = MilesPlugins(autoload=False, extra_plugins=[("surprise", Surprise())])
    cfg = tiny_config(tmp_path, "run.num_threads=1", "algorithm.advantage_estimator=surprise")
    summary, _ = run_loop(build(cfg, pm, tmp_path), lambda record: None)
    assert summary["status"] == "completed" and seen == [True, True]


def test_a_rollout_source_that_fails_to_close_does_not_hide_why_the_run_failed(tmp_path, caplog, monkeypatch):
    """The loop's finally closes the rollout source (one_step_off aborts the generation running ahead through the
    backend, whose engine may be what failed); its error there replaced the run's own, as run_end's did. While the
    run is failing, the close's error is logged and the run's goes on; after a run that succeeded it is raised."""
    from miles_core.errors import PluginError
    from miles_core.orchestration import loop

    make = loop.make_source

    def failing_to_close(*args):
        source = make(*args)

        def close():
            raise ConnectionError("engine gone")

        source.close = close
        return source

    monkeypatch.setattr(loop, "make_source", failing_to_close)

    class FailsInRollout:
        @hookimpl
        def miles_after_rollout(self, ctx, step, samples):
            raise KeyError("samples_table")

    pm = MilesPlugins(autoload=False, extra_plugins=[("table", FailsInRollout())])
    c = build(tiny_config(tmp_path, "run.num_threads=1", "run.num_rollout=1"), pm, tmp_path)
    with pytest.raises(PluginError, match="'table'.*samples_table.*miles_after_rollout"):
        run_loop(c, lambda record: None)
    assert any("ConnectionError" in r.getMessage() and "engine gone" in r.getMessage() for r in caplog.records)
    c = build(tiny_config(tmp_path, "run.num_threads=1", "run.num_rollout=1"), MilesPlugins(autoload=False), tmp_path)
    with pytest.raises(ConnectionError, match="engine gone"):
        run_loop(c, lambda record: None)


def test_a_step_that_dynamic_sampling_skips_pushes_no_weights(tmp_path):
    """Dynamic sampling keeps no group of step 2 (every reward 0): nothing is trained, so the unchanged weights are
    not pushed again and the version stays; step 3's samples come from step 1's weights (version 1)."""

    class StepRewards(Recorder):
        @hookimpl
        def miles_register_rewards(self, registry):
            # step 2: all equal; else a deterministic function of the sampled tokens (groups differ, as a rule)
            registry.add("step_reward", lambda s: 0.0 if s.metadata.get("step") == 2 else float(sum(s.response_ids) % 2))

    cfg = tiny_config(tmp_path, "run.num_rollout=3", "reward.name=step_reward", "algorithm.dynamic_sampling=true",
                      "algorithm.dynamic_sampling_max_rounds=0")
    rec = StepRewards()
    c = build(cfg, MilesPlugins(autoload=False, extra_plugins=[("recorder", rec)]), tmp_path)
    pushed = []
    push = c.transport.push
    c.transport.push = lambda weights, version, backend: (pushed.append(version), push(weights, version, backend))
    records = []
    summary, _ = run_loop(c, records.append)
    steps = {r["step"]: r for r in records}
    assert steps[2]["skipped"] == 1.0 and "loss" in steps[1] and "loss" in steps[3]
    assert pushed == [1, 2] and [call[1] for call in rec.calls if call[0] == "sync"] == [1, 2]
    assert [steps[k]["weight_version"] for k in (0, 1, 2, 3)] == [0, 1, 1, 2] and summary["weight_version"] == 2
    assert [call[3] for call in rec.calls if call[0] == "rollout"] == [{0}, set(), {1}]  # step 2 kept no sample


def test_a_task_failing_to_give_prompts_leaves_no_engine_open(tmp_path, monkeypatch):
    """The train and eval prompts (a plugin task's, a chat template's tokenization) are read before the placement
    launches engines and the trainer: a task that raises there leaves nothing running, and the error is its own."""
    import pytest

    from miles_core.errors import DataError
    from miles_core.orchestration import loop

    c = build(tiny_config(tmp_path, "run.num_rollout=1"), MilesPlugins(), tmp_path)
    opened, closed = [], []
    make = loop.make_placement

    def tracked(comp):
        p = make(comp)
        opened.append(p)
        close = p.close
        p.close = lambda: (closed.append(p), close())
        return p

    monkeypatch.setattr(loop, "make_placement", tracked)

    def broken():
        raise DataError("task 'broken': eval prompts could not be read")

    c.task.eval_prompts = broken
    with pytest.raises(DataError, match="broken"):
        run_loop(c, lambda record: None)
    assert opened == closed


def test_a_timeout_raised_by_reward_code_is_its_error_not_reward_timeout_s():
    """A verifier's own network timeout (urllib and sockets raise TimeoutError) was reported as
    "timed out after 30.0s", pointing at reward.timeout_s, a setting it had nothing to do with."""
    import pytest

    from miles_core.rewards.runner import RewardError, score_samples
    from miles_core.types import Sample

    def sync_http(sample):
        raise TimeoutError("read timed out")

    async def async_http(sample):
        raise TimeoutError("connect timed out")

    s = [Sample("p", [1], [2], "x", [0.0])]
    for fn in (sync_http, async_http):
        with pytest.raises(RewardError, match=r"^reward 'http' raised TimeoutError: \w+ timed out \(sample 0, prompt 'p'\)$"):
            score_samples(fn, "http", s, 30.0)


def test_a_sync_reward_may_run_its_own_event_loop():
    """A sync reward is plain code: one that drives an async client with asyncio.run (itself or inside a library)
    failed with "asyncio.run() cannot be called from a running event loop", the runner's own loop."""
    import asyncio

    from miles_core.rewards.runner import score_samples
    from miles_core.types import Sample

    async def remote(sample):
        await asyncio.sleep(0)
        return 0.25 * len(sample.response)

    def sync_client(sample):
        return asyncio.run(remote(sample))

    s = [Sample("p", [1], [2], "x", [0.0]), Sample("p", [1], [2], "xy", [0.0], index=1)]
    assert score_samples(sync_client, "client", s, 1.0) == [0.25, 0.5]
    assert score_samples(remote, "remote", s, 1.0) == [0.25, 0.5]  # and an async one is still awaited


def test_a_reward_too_large_for_a_float_is_refused_by_name():
    """An int beyond float's range (a verifier computing 2 ** n) made math.isfinite raise OverflowError: a
    traceback instead of the reward's error."""
    import pytest

    from miles_core.rewards.runner import RewardError, score_samples
    from miles_core.types import Sample

    with pytest.raises(RewardError, match="reward 'big' returned 1000000.* for sample 0; it must return a finite number"):
        score_samples(lambda s: 10 ** 400, "big", [Sample("p", [1], [2], "x", [0.0])], 1.0)


def test_an_async_reward_that_blocks_its_event_loop_is_an_error_not_a_hang():
    """`time.sleep` inside `async def` never yields, so asyncio's timeout cannot cancel it: scoring hung for as long as
    the reward blocked (for ever, for a server that never answers) and a slow one past the timeout returned normally."""
    import threading
    import time

    import pytest

    from miles_core.rewards.runner import BLOCKED_GRACE_S, RewardError, score_samples
    from miles_core.types import Sample

    release = threading.Event()

    async def blocking(sample):
        if sample.index == 1:
            release.wait(60)  # a synchronous call that does not return
        return 1.0

    samples = [Sample("p", [1], [2], "x", [0.0], index=i) for i in range(3)]
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardError, match=r"reward 'blocking' did not finish within reward.timeout_s=0.2s: sample 1 blocks"):
            score_samples(blocking, "blocking", samples, 0.2)
    finally:
        release.set()
    assert time.monotonic() - t0 < 0.2 + BLOCKED_GRACE_S + 1.0


def test_several_updates_per_rollout_log_the_mean_of_their_metrics(tmp_path, monkeypatch):
    """With train.updates_per_rollout=2 the step's record kept only the last update's loss, grad_norm, clip_frac (and the
    critic's value_loss ...): half the step was not in its metrics. Each is now the mean over the updates; lr, the
    schedule's value rather than a measurement, is the last update's."""
    from miles_core.train.critic import Critic

    critic_parts = []
    inner = Critic.train_step

    def critic_step(self, batch):
        out = inner(self, batch)
        critic_parts.append(out)
        return out

    monkeypatch.setattr(Critic, "train_step", critic_step)
    _dense_reward(tmp_path, monkeypatch)  # nonzero advantages, so that the two updates' metrics differ
    cfg = tiny_config(tmp_path, "train.updates_per_rollout=2", "run.num_rollout=1", "train.lr=0.01", "rollout.temperature=1.0",
                      "rollout.max_response_len=6", "reward.name=dense_reward:digit_share", "algorithm.advantage_estimator=ppo")
    c = build(cfg, MilesPlugins(autoload=False), tmp_path)
    parts = []
    spy_on_trainer(c, "train_step", lambda args, out: parts.append(out))
    records = []
    run_loop(c, records.append)
    (rl,) = [r for r in records if r.get("phase") == "rl" and r["step"] > 0]
    first, second = parts[-2:]  # the RL step's two updates (any SFT warm-up comes first)
    assert first["loss"] != second["loss"] and first["grad_norm"] != second["grad_norm"]
    for key in set(first) - {"mismatch_kl", "mismatch_k1"}:  # these the loop measures over the whole batch itself
        expected = second[key] if key == "lr" else (first[key] + second[key]) / 2
        assert rl[key] == pytest.approx(expected, rel=1e-12, abs=1e-15), (key, rl[key], first[key], second[key])
    assert len(critic_parts) == 2 and critic_parts[0]["value_loss"] != critic_parts[1]["value_loss"]
    for key in critic_parts[0]:
        assert rl[key] == pytest.approx((critic_parts[0][key] + critic_parts[1][key]) / 2, rel=1e-12, abs=1e-15), key


def test_a_diverged_run_s_summary_is_strict_json(tmp_path, monkeypatch):
    """An SFT run whose loss blew up (NaN) wrote 'NaN' into summary.json, which strict JSON readers (jq, JavaScript)
    refuse; metrics.jsonl already wrote null for it. (The trainers skip a step whose gradient is not finite, so the
    weights cannot diverge that way: the trainer here reports the NaN losses such a run reported.)"""
    from miles_core.train.torch_trainer import TorchTrainer

    step, calls = TorchTrainer.train_step, []

    def diverging(self, *args, **kwargs):  # finite at first, then NaN
        calls.append(1)
        out = step(self, *args, **kwargs)
        return out if len(calls) == 1 else {**out, "loss": float("nan"), "nll": float("nan")}

    monkeypatch.setattr(TorchTrainer, "train_step", diverging)
    summary = run(tiny_config(tmp_path, "run.mode=sft", "run.num_rollout=3"), MilesPlugins(autoload=False))
    assert summary["train_nll_last"] != summary["train_nll_last"]  # NaN: the run diverged
    text = (tmp_path / "runs" / next((tmp_path / "runs").iterdir()).name / "summary.json").read_text()
    written = json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert written["train_nll_last"] is None and written["train_nll_first"] == summary["train_nll_first"]


def test_sft_from_a_task_without_reference_answers_is_refused(tmp_path):
    """run.mode=sft without data.train_path trains on the task's reference answers. A task that has none (a plugin's,
    reasoning-gym's graph_color) made its example stream draw prompts forever without yielding one: the run hung
    at step 1. (The task here stops after 2,000 prompts, so that the old code fails instead of hanging.)"""
    import itertools

    from miles_core.data.synthetic import ReverseTask
    from miles_core.errors import DataError

    class NoAnswers(ReverseTask):
        name = "no_answers"

        def reference(self, prompt):
            return None

        def train_prompts(self, rng):
            return itertools.islice(super().train_prompts(rng), 2000)

    class Plugin:
        @hookimpl
        def miles_register_tasks(self, registry):
            registry.add("no_answers", lambda cfg: NoAnswers(cfg.num_eval))

    cfg = tiny_config(tmp_path, "run.mode=sft", "data.task=no_answers")
    pm = MilesPlugins(autoload=False, extra_plugins=[("no_answers", Plugin())])
    with pytest.raises(DataError, match=r"^run.mode=sft without data.train_path trains on the task's reference answers: "
                                        r"task 'no_answers' gave none for 1000 training prompts in a row"):
        run_loop(build(cfg, pm, tmp_path), lambda r: None)


def test_response_len_counts_the_response_not_its_trained_tokens(tmp_path):
    """With loss masks (a tool's output inside a multi-turn response, not trained on) response_len was the trained
    tokens per sample, not the response length; run.mode=rollout reports the length, so the two disagreed."""

    class MaskLast:
        def __init__(self):
            self.lengths: list[float] = []

        @hookimpl
        def miles_after_rollout(self, ctx, step, samples):
            for s in samples:
                s.loss_mask = [1] * (len(s.response_ids) - 1) + [0]
            self.lengths.append(sum(len(s.response_ids) for s in samples) / len(samples))

    plugin = MaskLast()
    records = []
    pm = MilesPlugins(autoload=False, extra_plugins=[("mask", plugin)])
    run_loop(build(tiny_config(tmp_path, "run.num_rollout=2", "rollout.max_response_len=6"), pm, None), records.append)
    rl = [r for r in records if r.get("phase") == "rl" and r["step"] > 0]
    assert [r["response_len"] for r in rl] == pytest.approx(plugin.lengths) and min(plugin.lengths) > 1


def test_a_bad_sft_example_file_is_refused_when_the_run_is_built(tmp_path):
    """run.mode=sft read data.train_path's (prompt, response) examples only when its example stream was first drawn
    from, after the engines had started and the step-0 eval had decoded every held-out prompt (minutes on a real
    model), and `miles validate` (which builds) passed the file. A bad line is now refused by build."""
    from miles_core.errors import DataError

    examples = tmp_path / "sft.jsonl"
    examples.write_text(json.dumps({"prompt": "abc", "response": "cba"}) + "\n" + json.dumps({"prompt": "abc"}) + "\n")
    cfg = tiny_config(tmp_path, "run.mode=sft", "data.task=reverse", f"data.train_path={examples}")
    with pytest.raises(DataError, match=r"sft.jsonl:2: missing key 'response' \(set data.response_key\)$"):
        build(cfg, MilesPlugins(autoload=False), tmp_path)
    examples.write_text(json.dumps({"prompt": "abc", "response": "cba"}) + "\n")
    c = build(cfg, MilesPlugins(autoload=False), tmp_path)
    assert [(s.prompt, s.response) for s in c.sft_examples] == [("abc", "cba")]


def test_run_mode_sft_follows_the_lr_schedule(tmp_path):
    """run.mode=sft passed every step train.sft_lr (or train.lr) as a fixed LR, so train.lr_warmup_steps and
    train.lr_decay were silently ignored: an SFT run configured with warm-up and cosine decay trained at the peak LR
    from its first step to its last. Its steps now follow the schedule, with train.sft_lr (or train.lr) as the peak."""
    import math

    sched = ["run.mode=sft", "run.num_rollout=4", "run.eval_every=4", "train.sft_batch_size=2",
             "train.lr_warmup_steps=2", "train.lr_decay=cosine", "train.min_lr=0.001"]
    for peak, extra in ((0.01, ["train.lr=0.01"]), (0.02, ["train.lr=0.01", "train.sft_lr=0.02"])):
        records = []
        run_loop(build(tiny_config(tmp_path, *sched, *extra), MilesPlugins(autoload=False), tmp_path), records.append)
        lrs = [r["lr"] for r in records if r["step"] > 0]
        cosine = [0.001 + (peak - 0.001) * 0.5 * (1 + math.cos(math.pi * p / 2)) for p in (0, 1)]
        assert lrs == pytest.approx([peak / 2, peak, *cosine], rel=1e-12)
    from miles_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^train.min_lr \(0.001\) must not exceed train.sft_lr \(0.0005\)"):
        build(tiny_config(tmp_path, *sched, "train.sft_lr=0.0005"), MilesPlugins(autoload=False), tmp_path)


def test_sft_examples_outside_the_character_alphabet_are_refused(tmp_path):
    """The built-in character tokenizer encodes a character outside its alphabet as <unk>. The start-up check named
    such characters in the task's prompts and answers, but not in run.mode=sft's data.train_path examples: a response
    in capitals was trained on as a row of <unk> tokens (no error; decoding drops them, so the model learns to say
    nothing)."""
    from miles_core.errors import DataError

    examples = tmp_path / "sft.jsonl"
    for row, what in (({"prompt": "abc", "response": "CbA"}, r"the response 'CbA' has characters .*: 'A', 'C'"),
                      ({"prompt": "aBc", "response": "cba"}, r"the prompt 'aBc' has characters .*: 'B'")):
        examples.write_text(json.dumps({"prompt": "ab", "response": "ba"}) + "\n" + json.dumps(row) + "\n")
        cfg = tiny_config(tmp_path, "run.mode=sft", "data.task=reverse", f"data.train_path={examples}")
        with pytest.raises(DataError, match=rf"^{examples}:2: {what}"):
            build(cfg, MilesPlugins(autoload=False), tmp_path)


def test_an_async_reward_whose_own_code_is_cancelled_is_an_error_naming_the_sample():
    """asyncio.CancelledError is a BaseException: one raised by the reward's own code (a client cancelling its request,
    awaiting a task it cancelled) escaped the runner as a bare CancelledError, naming neither the reward nor the
    sample. A sample cancelled because another one failed is still reported as that one's error."""
    import asyncio

    import pytest

    from miles_core.rewards.runner import RewardError, score_samples
    from miles_core.types import Sample

    async def cancelled_request(sample):
        if sample.index == 1:
            request = asyncio.ensure_future(asyncio.sleep(10))
            await asyncio.sleep(0)
            request.cancel()
            await request  # raises CancelledError in the reward's own task
        await asyncio.sleep(0.01)
        return 1.0

    samples = [Sample("p", [1], [2], "x", [0.0], index=i) for i in range(3)]
    with pytest.raises(RewardError, match=r"^reward 'rm' raised CancelledError \(sample 1, prompt 'p'\)$"):
        score_samples(cancelled_request, "rm", samples, 5.0)

    async def one_fails(sample):
        if sample.index == 2:
            raise ValueError("bad answer")
        await asyncio.sleep(5)  # cancelled when sample 2 fails
        return 1.0

    with pytest.raises(RewardError, match=r"^reward 'rm' raised ValueError: bad answer \(sample 2, prompt 'p'\)$"):
        score_samples(one_fails, "rm", samples, 30.0)
