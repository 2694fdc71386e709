"""Schedules, deterministic seeds, saved rollouts and --resume, end to end on a tiny CPU config."""

import contextlib
import dataclasses
import json
import re
import threading
import time

import pytest

from miles_core.errors import ConfigError, DataError
from miles_core.hookspecs import hookimpl
from miles_core.orchestration.build import build
from miles_core.orchestration.loop import run_loop
from miles_core.orchestration.rollout_io import load_rollouts
from miles_core.plugins.manager import MilesPlugins
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.core import EngineCore
from miles_core.testing.contracts import tiny_config
from miles_core.types import Prompt

TRAIN_KEYS = ("reward_mean", "loss", "clip_frac", "grad_norm", "approx_kl", "entropy", "adv_std", "mismatch_kl", "response_len")


class Versions:
    """Records, per step, the weight versions of the samples and the trainer's version then."""

    def __init__(self):
        self.rollouts, self.synced = {}, [0]

    @hookimpl
    def miles_after_rollout(self, ctx, step, samples):
        self.rollouts[step] = (self.synced[-1], [s.weight_version for s in samples], [tuple(s.response_ids) for s in samples])

    @hookimpl
    def miles_after_weight_sync(self, ctx, version):
        self.synced.append(version)


def _run(cfg, *plugins):
    records = []
    pm = MilesPlugins(autoload=False, extra_plugins=[(f"p{i}", p) for i, p in enumerate(plugins)])
    summary, _ = run_loop(build(cfg, pm, None), records.append)
    return summary, [r for r in records if r.get("phase") == "rl" and r["step"] > 0]


def test_per_sample_seeds_do_not_depend_on_the_batch(tmp_path):
    """Deterministic mode: a prompt's samples are the same alone or among other prompts."""
    cfg = tiny_config(tmp_path, "rollout.temperature=1.0")
    c = build(cfg, MilesPlugins(autoload=False), None)
    backend = c.backend_factory(c.ctx, c.model)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    tok = c.ctx.tokenizer

    def prompt(text, seed):
        return Prompt(text, prompt_ids=tok.encode(text), metadata={"sampling_seed": seed})

    alone = backend.generate([prompt("12+7=", 99)], params, n=3)
    mixed = backend.generate([prompt("3+4=", 5), prompt("12+7=", 99), prompt("8+8=", 6)], params, n=3)
    assert [s.response_ids for s in alone] == [s.response_ids for s in mixed[3:6]]
    flat = lambda ss: [x for s in ss for x in s.rollout_logprobs]  # noqa: E731
    assert flat(alone) == pytest.approx(flat(mixed[3:6]), abs=1e-5)
    assert len({tuple(s.response_ids) for s in alone}) > 1  # the 3 samples of the group differ (seed + i)


def test_one_step_off_samples_are_exactly_one_version_behind(tmp_path):
    cfg = tiny_config(tmp_path, "run.num_rollout=4", "orchestration.schedule=one_step_off", "orchestration.deterministic=true")
    rec = Versions()
    summary, records = _run(cfg, rec)
    assert summary["status"] == "completed" and summary["weight_version"] == 4
    assert len(records) == 4 and all(r["loss"] == r["loss"] for r in records)
    # step 1 is generated with v0 before anything overlaps; step k >= 2 was generated while step
    # k-1 trained, with v_{k-2}, and is trained when the trainer holds v_{k-1}: staleness 1
    for step, (trainer_version, versions, _) in rec.rollouts.items():
        assert trainer_version == step - 1
        assert set(versions) == {max(step - 2, 0)}, (step, versions)
        assert trainer_version - min(versions) <= 1


class StopsAfterTraining:
    """Ctrl-C (or an error) while step 1 trains; ``t`` is when."""

    @hookimpl
    def miles_after_train_step(self, ctx, step, metrics):
        self.t = time.monotonic()
        raise KeyboardInterrupt


def _slow_generation_ahead(monkeypatch) -> None:
    """Each engine step of one_step_off's generation ahead (its rollout thread) takes 1 s more."""
    step = EngineCore.step
    ahead = lambda: threading.current_thread().name.startswith("miles-rollout")  # noqa: E731
    monkeypatch.setattr(EngineCore, "step", lambda self: (time.sleep(1.0) if ahead() else None) or step(self))


def test_one_step_off_stops_without_finishing_the_next_steps_rollout(tmp_path, monkeypatch):
    # the run stops (Ctrl-C, SIGTERM, an error) while step 2's samples are being generated ahead: closing the schedule
    # waited for that whole generation, whose samples nobody will train on (minutes, on a real rollout)
    _slow_generation_ahead(monkeypatch)
    cfg = tiny_config(tmp_path, "run.num_rollout=3", "orchestration.schedule=one_step_off", "orchestration.deterministic=true",
                      "rollout.max_response_len=64", "rollout.temperature=1.0")
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, StopsAfterTraining())
    assert time.monotonic() - t0 < 5.0  # the generation ahead takes about 9 s


def test_one_step_off_stops_without_scoring_the_aborted_rollout(tmp_path, monkeypatch):
    # the generation ahead, aborted when the run stops, still had each of its (partial) samples scored by the reward,
    # one after another, before the run could end: 8 s here with a verifier of 1 s a sample, minutes on a real batch
    _slow_generation_ahead(monkeypatch)
    cfg = tiny_config(tmp_path, "run.num_rollout=3", "orchestration.schedule=one_step_off", "rollout.max_response_len=64",
                      "rollout.temperature=1.0", "reward.name=orch_rewards:slow_ahead")
    stop = StopsAfterTraining()
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, stop)
    assert time.monotonic() - stop.t < 3.0


def test_sync_schedule_is_on_policy(tmp_path):
    rec = Versions()
    _run(tiny_config(tmp_path, "run.num_rollout=3"), rec)
    assert {step: set(v) for step, (_, v, _) in rec.rollouts.items()} == {1: {0}, 2: {1}, 3: {2}}


def test_training_from_saved_rollouts_reproduces_the_run(tmp_path):
    saved = tmp_path / "rollouts"
    cfg = tiny_config(tmp_path, "run.num_rollout=3", f"run.save_rollouts={saved}", "orchestration.deterministic=true")
    _, first = _run(cfg)
    assert sorted(p.name for p in saved.iterdir()) == ["step_1.jsonl", "step_2.jsonl", "step_3.jsonl"]
    rows = [json.loads(line) for line in (saved / "step_2.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["reward"] is not None and r["weight_version"] == 1 for r in rows)
    cfg2 = tiny_config(tmp_path, "run.num_rollout=3", f"run.load_rollouts={saved}")
    pm = MilesPlugins(autoload=False)
    c = build(cfg2, pm, None)
    c.backend_factory = None  # train-only: the loop must not build an engine
    records = []
    summary, _ = run_loop(c, records.append)
    second = [r for r in records if r["step"] > 0]
    assert summary["status"] == "completed" and "eval_accuracy" not in second[-1]
    for a, b in zip(first, second, strict=True):
        for key in TRAIN_KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_training_from_saved_rollouts_reports_no_generation_throughput(tmp_path):
    """Saved rollouts take no generation time (time_generate 0.0): rollout_tok_s was tokens / 1e-9, trillions
    of tokens per second in metrics.jsonl and the live table."""
    saved = tmp_path / "rollouts"
    _, first = _run(tiny_config(tmp_path, "run.num_rollout=1", f"run.save_rollouts={saved}"))
    assert 0 < first[0]["rollout_tok_s"] < 1e9
    _, second = _run(tiny_config(tmp_path, "run.num_rollout=1", f"run.load_rollouts={saved}"))
    assert second[0]["time_generate"] == 0.0 and "rollout_tok_s" not in second[0]


def test_saved_rollouts_of_another_model_are_refused_with_their_file(tmp_path):
    # rollouts saved by a run of another model (another tokenizer) hold ids the trainer's embedding does not have:
    # that failed in the trainer's forward with 'IndexError: index out of range in self'
    saved = tmp_path / "rollouts"
    _run(tiny_config(tmp_path, "run.num_rollout=1", f"run.save_rollouts={saved}"))
    rows = [json.loads(line) for line in (saved / "step_1.jsonl").read_text().splitlines()]
    rows[2]["response_ids"][0] = 5000
    (saved / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = build(tiny_config(tmp_path, "run.num_rollout=1", f"run.load_rollouts={saved}"), MilesPlugins(autoload=False), None)
    with pytest.raises(DataError, match=r"step_1.jsonl line 3: token id 5000 is outside the model's vocabulary \(52 ids\)"):
        run_loop(c, lambda r: None)


def _strip_logprobs(saved, rows_without):
    """Saved rollouts whose rows ``rows_without`` carry no engine logprobs (``"rollout_logprobs": []``, as a row
    written by another tool, or by a backend that gives none, legally has)."""
    path = saved / "step_1.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for i in rows_without:
        assert rows[i]["response_ids"]
        rows[i]["rollout_logprobs"] = []
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("old_logprobs", ["auto", "recompute"])
def test_saved_rollouts_without_engine_logprobs_report_no_mismatch_metrics(tmp_path, old_logprobs):
    """Samples without the engine's logprobs were given zeros for them, so mismatch_kl / mismatch_k1 / mismatch_abs
    compared the trainer's logprobs with 0 (large, meaningless numbers in metrics.jsonl): they are left out instead."""
    saved = tmp_path / "rollouts"
    _run(tiny_config(tmp_path, "run.num_rollout=1", f"run.save_rollouts={saved}"))
    _strip_logprobs(saved, [1, 4])
    summary, records = _run(tiny_config(tmp_path, "run.num_rollout=1", f"run.load_rollouts={saved}",
                                        f"train.old_logprobs={old_logprobs}"))
    assert summary["status"] == "completed" and "loss" in records[0]
    assert not {"mismatch_kl", "mismatch_k1", "mismatch_abs"} & set(records[0]), records[0]


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_mismatch_correction_refuses_samples_without_engine_logprobs(tmp_path, correction):
    """With zeros for the missing engine logprobs, TIS weighted each token by its old-policy probability (not ~1) and
    MIS dropped the unlikely ones: the step is refused, before the trainer sees the batch."""
    saved = tmp_path / "rollouts"
    _run(tiny_config(tmp_path, "run.num_rollout=1", f"run.save_rollouts={saved}"))
    _strip_logprobs(saved, [1, 4, 6])
    c = build(tiny_config(tmp_path, "run.num_rollout=1", f"run.load_rollouts={saved}",
                          f"algorithm.mismatch_correction={correction}"), MilesPlugins(autoload=False), None)
    calls = []
    make = c.trainer_factory

    def factory(*args, **kwargs):
        trainer = make(*args, **kwargs)
        for name in ("compute_logprobs", "train_step"):
            inner = getattr(trainer, name)
            setattr(trainer, name, lambda *a, _inner=inner, _name=name, **kw: calls.append(_name) or _inner(*a, **kw))
        return trainer

    c.trainer_factory = factory
    with pytest.raises(DataError, match=rf"algorithm.mismatch_correction={correction} needs the rollout engine's per-token "
                                        rf"logprobs; 3 of 8 samples of step 1 have none \(saved rollouts in {re.escape(str(saved))} without "
                                        rf"'rollout_logprobs'\)"):
        run_loop(c, lambda r: None)
    assert calls == []


@pytest.mark.parametrize("edit, problem", [
    (lambda row: [row], "a JSON object, got list"),
    (lambda row: {**row, "prompt_ids": "abc"}, "'prompt_ids' must be a list of token ids"),
    (lambda row: {**row, "response_ids": None}, "'response_ids' must be a list of token ids"),
    (lambda row: {**row, "reward": "x"}, "'reward' must be a finite number, got 'x'"),
    (lambda row: {**row, "reward": None}, "'reward' must be a finite number, got None"),
    (lambda row: {**row, "rollout_logprobs": [0.0] * 9}, r"'rollout_logprobs' has 9 values for \d response tokens"),
    (lambda row: {**row, "prompt_ids": []}, "'prompt_ids' is empty: the first response token's logprob needs a prompt"),
    (lambda row: {**row, "loss_mask": [1] * 9}, r"'loss_mask' has 9 values for \d response tokens"),
    (lambda row: {**row, "loss_mask": "all"}, "'loss_mask' must be a list of 0/1 values or null"),
])
def test_a_saved_rollout_row_that_is_not_a_sample_is_named(tmp_path, edit, problem):
    """Rollouts edited by hand or written by another tool: a row that is not an object, ids that are not lists of
    ints, a reward that is not a number went through as AttributeError / TypeError tracebacks, at load or in
    training (a reward of 'x' was accepted and failed in the advantage estimator)."""
    saved = tmp_path / "rollouts"
    _run(tiny_config(tmp_path, "run.num_rollout=1", f"run.save_rollouts={saved}", "rollout.max_response_len=4"))
    rows = [json.loads(line) for line in (saved / "step_1.jsonl").read_text().splitlines()]
    rows[1] = edit(rows[1])
    (saved / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=rf"step_1.jsonl line 2: not a saved sample \({problem}"):
        load_rollouts(saved, 1, 52)


def test_rollout_mode_saves_samples_and_does_not_train(tmp_path):
    cfg = tiny_config(tmp_path, "run.mode=rollout", "run.num_rollout=2")
    pm = MilesPlugins(autoload=False)
    c = build(cfg, pm, tmp_path / "out")
    c.trainer_factory = None  # rollout only: no trainer is built
    records = []
    summary, trainer = run_loop(c, records.append)
    assert trainer is None and summary["weight_version"] == 0
    samples = load_rollouts(tmp_path / "out" / "rollouts", 2)
    assert len(samples) == 8 and {s.weight_version for s in samples} == {0}
    assert records[-1]["reward_mean"] == pytest.approx(sum(s.reward for s in samples) / 8)
    assert "loss" not in records[-1]


def test_rollout_mode_records_the_version_the_engines_hold(tmp_path):
    """run.mode=rollout against engines that already hold trained weights (servers given by rollout.sglang.urls report
    the version they were pushed): the samples carry the engines' version, and the records and summary said 0. Here
    the built-in engine is set to hold version 4, as such a server reports it."""
    cfg = tiny_config(tmp_path, "run.mode=rollout", "run.num_rollout=1")
    c = build(cfg, MilesPlugins(autoload=False), tmp_path / "out")
    c.trainer_factory = None
    make = c.backend_factory

    def holding_version_4(ctx, model):
        backend = make(ctx, model)
        backend.core.weight_version = 4
        return backend

    c.backend_factory = holding_version_4
    records = []
    summary, _ = run_loop(c, records.append)
    samples = load_rollouts(tmp_path / "out" / "rollouts", 1)
    assert {s.weight_version for s in samples} == {4}
    assert [r["weight_version"] for r in records] == [4, 4] and summary["weight_version"] == 4


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, cli):
    out = cli("run", f"run.output_dir={tmp_path}", f"--save={tmp_path / 'ckpt'}", "--resume")
    assert out.returncode == 2
    assert "--resume" in out.stderr and "holds no checkpoint" in out.stderr
    with pytest.raises(ConfigError, match="needs run.save"):
        tiny_config(tmp_path, "run.resume=true")


def test_resume_continues_the_newest_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    _run(tiny_config(tmp_path, "run.num_rollout=2", f"run.save={save}", "run.save_interval=1"))
    cfg = tiny_config(tmp_path, "run.num_rollout=3", f"run.save={save}", "run.resume=true")
    summary, records = _run(cfg)
    assert cfg.run.load == str(save)
    assert [r["step"] for r in records] == [3] and summary["weight_version"] == 3


class Partials:
    @hookimpl
    def miles_after_rollout(self, ctx, step, samples):
        self.steps = getattr(self, "steps", {})
        self.steps[step] = [(s.weight_version, s.metadata["weight_versions"], s.metadata["resumed_at"], len(s.response_ids), s.finish_reason) for s in samples]


def test_async_partial_rollouts_are_continued_within_the_staleness_bound(tmp_path, monkeypatch):
    # A weight update cuts the requests still running. Whether any are depends on how long a rollout takes
    # against a train step: the engine's steps are slowed (15 ms each) so that the next batch is still being
    # generated when a train step ends, however fast this machine's CPU kernels are.
    step = EngineCore.step
    monkeypatch.setattr(EngineCore, "step", lambda self: time.sleep(0.015) or step(self))
    cfg = tiny_config(
        tmp_path, "run.num_rollout=4", "orchestration.schedule=async", "orchestration.max_staleness=1",
        "orchestration.deterministic=true", "rollout.max_response_len=24", "rollout.temperature=1.0",
    )
    rec = Partials()
    summary, records = _run(cfg, rec)
    assert summary["status"] == "completed" and summary["weight_version"] == 4
    assert all(r["loss"] == r["loss"] for r in records)
    resumed = 0
    for step, rows in rec.steps.items():
        trainer_version = step - 1
        assert len(rows) == 8
        for oldest, versions, resumed_at, length, reason in rows:
            assert trainer_version - oldest <= 1  # the staleness bound
            assert oldest == versions[0] and versions == sorted(versions)
            assert len(versions) == len(resumed_at) + 1 and reason in ("stop", "length")
            # a continuation resumes where the sample stopped: increasing lengths, within the budget
            assert resumed_at == sorted(resumed_at) and all(0 < a <= length for a in resumed_at) and length <= 24, (versions, resumed_at, length, reason)
            if resumed_at:  # the part before the cut was sampled with older weights than the part after
                assert all(a < b for a, b in zip(versions, versions[1:]))
            resumed += bool(resumed_at)
    assert resumed > 0  # some samples were cut by a weight update and continued with newer weights


def test_async_rollout_mode_does_not_cut_requests_between_steps(tmp_path, monkeypatch):
    """run.mode=rollout pushes no weights: the async schedule was still paused after every step (the loop's weight-sync
    point), which aborted every running request and continued it as a new one, so the saved samples came in pieces
    (metadata resumed_at) for no update. Only an eval needs the engine idle; here there is one, after the last step."""
    step = EngineCore.step
    monkeypatch.setattr(EngineCore, "step", lambda self: time.sleep(0.015) or step(self))
    cfg = tiny_config(tmp_path, "run.mode=rollout", "run.num_rollout=3", "run.eval_every=100", "orchestration.schedule=async",
                      "rollout.max_response_len=24", "rollout.temperature=1.0")
    c = build(cfg, MilesPlugins(autoload=False, extra_plugins=[("partials", rec := Partials())]), tmp_path / "out")
    c.trainer_factory = None
    records = []
    summary, _ = run_loop(c, records.append)
    assert summary["status"] == "completed" and sorted(rec.steps) == [1, 2, 3]
    rows = [row for step_rows in rec.steps.values() for row in step_rows]
    assert len(rows) == 24 and all(resumed_at == [] and versions == [0] for _, versions, resumed_at, _, _ in rows)
    assert [r["async_resumed_samples"] for r in records if r["step"] > 0] == [0.0, 0.0, 0.0]


class SlowTraining:
    """A train step that takes 0.5 s: the async rollout fills its queue meanwhile."""

    @hookimpl
    def miles_after_train_step(self, ctx, step, metrics):
        time.sleep(0.5)


def test_async_rollout_throughput_is_the_engines(tmp_path, monkeypatch):
    # rollout_tok_s was the step's tokens over the loop's wait for them: with the queue full (training slower than
    # rollout, what async is for) that wait is ~0 and the "throughput" came out at ~1e6 tok/s. Every engine step here
    # takes >= 15 ms and gives at most 16 rows (2 x 4 groups x 2 samples) x 8 tokens (a decode window).
    step = EngineCore.step
    monkeypatch.setattr(EngineCore, "step", lambda self: time.sleep(0.015) or step(self))
    cfg = tiny_config(tmp_path, "run.num_rollout=3", "orchestration.schedule=async", "rollout.max_response_len=24",
                      "rollout.temperature=1.0")
    _, records = _run(cfg, SlowTraining())
    assert len(records) == 3
    assert all(0 < r["rollout_tok_s"] <= 16 * 8 / 0.015 for r in records), [r["rollout_tok_s"] for r in records]


def test_async_rollout_stops_once_the_last_steps_samples_are_taken(tmp_path, monkeypatch):
    # after the last step's get, the rollout thread went on generating (and drawing prompts, which the final checkpoint
    # counted as consumed) through the last train step, weight sync, eval and save, for samples nobody trains on
    taken, late = threading.Event(), []
    step = EngineCore.step

    def counted(self):
        if taken.is_set() and threading.current_thread().name == "miles-async-rollout":
            late.append(1)
        return step(self)

    class LastRollout:
        @hookimpl
        def miles_after_rollout(self, ctx, step, samples):
            if step == 3:
                taken.set()

    monkeypatch.setattr(EngineCore, "step", counted)
    cfg = tiny_config(tmp_path, "run.num_rollout=3", "orchestration.schedule=async", "rollout.max_response_len=24",
                      "rollout.temperature=1.0")
    summary, records = _run(cfg, LastRollout(), SlowTraining())
    assert summary["status"] == "completed" and len(records) == 3
    assert len(late) == 0


class SlowParityReward:
    """A reward that takes 50 ms a sample (a verifier), 1 for responses with an odd token sum: groups differ, mostly."""

    @hookimpl
    def miles_register_rewards(self, registry):
        registry.add("slow_parity", lambda s: time.sleep(0.05) or float(sum(s.response_ids) % 2))


def test_rollout_throughput_is_the_generated_tokens_over_the_generation(tmp_path):
    """rollout_tok_s was the kept samples' tokens over the generation and the scoring: a slow reward made the engine
    look several times slower, and the groups dynamic sampling dropped (generated all the same) did not count."""
    cfg = tiny_config(tmp_path, "run.num_rollout=2", "reward.name=slow_parity", "algorithm.dynamic_sampling=true",
                      "rollout.temperature=1.0", "rollout.max_response_len=12")
    c = build(cfg, MilesPlugins(autoload=False, extra_plugins=[("reward", SlowParityReward())]), None)
    generated = {}  # step -> [tokens, seconds] of its rollout's generate calls
    make = c.backend_factory

    def factory(*args):
        backend = make(*args)
        inner = backend.generate

        def generate(prompts, params, n=1):
            t0 = time.perf_counter()
            out = inner(prompts, params, n=n)
            step = prompts[0].metadata.get("step")  # the eval's prompts have none
            if step is not None:
                seen = generated.setdefault(step, [0, 0.0])
                seen[0] += sum(len(s.response_ids) for s in out)
                seen[1] += time.perf_counter() - t0
            return out

        backend.generate = generate
        return backend

    c.backend_factory = factory
    records = []
    run_loop(c, records.append)
    for r in (r for r in records if r["step"] > 0):
        tokens, seconds = generated[r["step"]]
        assert r["rollout_tok_s"] == pytest.approx(tokens / seconds, rel=0.2), (r["step"], tokens, seconds)


class TrainedPrompts:
    """Per step, the prompts of the samples handed to the trainer (one per group); raises Killed after ``kill_after``."""

    def __init__(self, kill_after=None):
        self.steps, self.kill_after = {}, kill_after

    @hookimpl
    def miles_after_rollout(self, ctx, step, samples):
        self.steps[step] = [s.prompt for s in samples if s.index % ctx.config.rollout.n_samples_per_prompt == 0]

    @hookimpl
    def miles_after_train_step(self, ctx, step, metrics):
        if self.kill_after is not None and step > self.kill_after:
            raise KeyboardInterrupt


@pytest.mark.parametrize("schedule", ["one_step_off"])
def test_a_resumed_run_trains_every_prompt_once(tmp_path, schedule):
    # one_step_off draws step k+1's prompts while step k trains; the checkpoint after step k counted them as consumed,
    # so the resumed run started one batch further in the stream: those prompts were never trained on
    save = tmp_path / "ckpt"
    args = ("run.num_rollout=4", f"orchestration.schedule={schedule}", "rollout.max_response_len=8", "run.eval_every=100")
    full = TrainedPrompts()
    _run(tiny_config(tmp_path / "a", *args), full)
    first = TrainedPrompts(kill_after=2)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_config(tmp_path / "b", *args, f"run.save={save}", "run.save_interval=2"), first)
    saved = json.loads((save / "step_000002" / "loop.json").read_text())
    assert (saved["prompts_consumed"], saved["prompts_pending"]) == (3 * 4, [8, 9, 10, 11])  # step 3's, drawn ahead
    second = TrainedPrompts()
    _run(tiny_config(tmp_path / "c", *args, f"run.save={save}", "run.resume=true"), second)
    assert sorted(second.steps) == [3, 4]
    assert [first.steps[1], first.steps[2], second.steps[3], second.steps[4]] == [full.steps[k] for k in (1, 2, 3, 4)]


class Responses:
    @hookimpl
    def miles_after_rollout(self, ctx, step, samples):
        self.rows = getattr(self, "rows", []) + [(s.response, ctx.tokenizer.decode(s.response_ids), s.finish_reason) for s in samples]


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_response_ends_before_its_stop_string_with_every_schedule(tmp_path, schedule):
    # the async schedule built its samples' text from every generated token: a response stopped by a stop string kept it
    # (the built-in engine and SGLang leave it out), so rewards and task scores saw another text under async
    cfg = tiny_config(tmp_path, "run.num_rollout=2", f"orchestration.schedule={schedule}", "rollout.max_response_len=24",
                      "rollout.temperature=1.0", "rollout.stop=[\"1\",\"2\",\"3\"]")
    rec = Responses()
    _run(cfg, rec)
    stopped = [(resp, full) for resp, full, reason in rec.rows if reason == "stop" and any(s in full for s in "123")]
    assert len(stopped) > 0  # the stop strings were met
    assert all(not any(s in resp for s in "123") for resp, _, _ in rec.rows)
    assert all(full.startswith(resp) for resp, full in stopped)


class MarkedPrecision:
    """A plugin's precision recipe 'marked' whose kernel_mode notes which threads are inside it; EngineCore.step then
    records whether it ran there (as a batch-invariant recipe's kernel swap would apply or not)."""

    def __init__(self):
        self.inside, self.steps = set(), []

    @hookimpl
    def miles_register_precision_recipes(self, registry):
        from miles_core.precision.base import PrecisionRecipe

        marks = self

        @dataclasses.dataclass(frozen=True)
        class Marked(PrecisionRecipe):
            def kernel_mode(self, device):
                return marks.mode()

        registry.add("marked", Marked("marked"))

    @contextlib.contextmanager
    def mode(self):
        me = threading.get_ident()
        self.inside.add(me)
        try:
            yield
        finally:
            self.inside.discard(me)


@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "async"])
def test_every_rollout_engine_step_runs_in_the_precision_recipes_kernel_mode(tmp_path, monkeypatch, schedule):
    # the async schedule steps the built-in engine from its own thread, outside the recipe's kernel_mode that
    # BuiltinEngine.generate enters: a batch-invariant recipe's rollout ran on the default kernels, its logprobs off the
    # trainer's (the recipe promises that every engine step runs inside it)
    marks = MarkedPrecision()
    step = EngineCore.step

    def marked(self):
        if self.has_unfinished():  # not the empty step after a shutdown's aborts
            marks.steps.append(threading.get_ident() in marks.inside)
        return step(self)

    monkeypatch.setattr(EngineCore, "step", marked)
    cfg = tiny_config(tmp_path, "run.num_rollout=2", f"orchestration.schedule={schedule}", "train.precision=marked",
                      "rollout.max_response_len=24", "rollout.temperature=1.0")
    summary, _ = _run(cfg, marks)
    assert summary["status"] == "completed" and len(marks.steps) >= 4, marks.steps
    assert all(marks.steps), f"{marks.steps.count(False)} of {len(marks.steps)} engine steps outside kernel_mode"


def test_async_with_sglang_engines_is_refused_before_anything_runs(tmp_path):
    # schedule=async drives the built-in engine's core in process; with rollout.backend=sglang the run found out only
    # when the loop made the schedule: after launching the servers, the SFT warm-up and the first eval (and miles
    # validate passed it)
    cfg = tiny_config(tmp_path, "orchestration.schedule=async", "rollout.backend=sglang")
    with pytest.raises(ConfigError, match=r"schedule=async .*rollout.backend=builtin"):
        build(cfg, MilesPlugins(autoload=False), None)


def test_an_async_resume_trains_the_prompts_in_flight_at_the_checkpoint(tmp_path):
    # the async rollout thread keeps ~2 batches of groups in flight or waiting; the checkpoint counted their prompts as
    # consumed, so a resumed run skipped them (up to two batches a resume, never trained). They are now recorded as
    # pending and drawn first by the resumed run: no prompt is lost, none trained twice
    import random

    save = tmp_path / "ckpt"
    args = ("orchestration.schedule=async", "orchestration.max_staleness=100", "rollout.max_response_len=8",
            "run.eval_every=100", f"run.save={save}")
    first = TrainedPrompts(kill_after=2)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_config(tmp_path / "b", *args, "run.num_rollout=4", "run.save_interval=2"), first, SlowTraining())
    saved = json.loads((save / "step_000002" / "loop.json").read_text())
    second = TrainedPrompts()
    _run(tiny_config(tmp_path / "c", *args, "run.num_rollout=4", "run.resume=true"), second)
    final = json.loads((save / "step_000004" / "loop.json").read_text())
    cfg = tiny_config(tmp_path / "d")
    task = build(cfg, MilesPlugins(autoload=False), None).task
    stream = [p.text for _, p in zip(range(final["prompts_consumed"]), task.train_prompts(random.Random(cfg.run.seed)))]
    assert len(set(stream)) == len(stream)  # a prompt's text names its place in the stream
    where = {text: i for i, text in enumerate(stream)}
    before = [where[t] for k in (1, 2) for t in first.steps[k]]
    after = [where[t] for k in (3, 4) for t in second.steps[k]]
    pending = saved["prompts_pending"]
    assert len(pending) >= 4  # the thread had groups in flight or waiting when step 2 was saved
    assert len(set(before + after)) == len(before + after) == 16  # no prompt trained twice
    assert set(before) | set(pending) == set(range(saved["prompts_consumed"]))  # drawn: trained or pending
    assert set(pending) <= set(after) | set(final["prompts_pending"])  # each pending one trained after, or still pending


def test_resuming_a_finished_async_run_evaluates_on_an_idle_engine(tmp_path, monkeypatch):
    # a resume whose checkpoint is already at run.num_rollout trains nothing and scores the held-out set; the async
    # schedule had been made all the same, and its rollout thread drew prompts and stepped the engine core while that
    # eval stepped it too (two threads in one EngineCore). Main-thread steps here wait (up to 2 s, once) for the
    # rollout thread to step, so that a thread running beside the eval is always seen
    save = tmp_path / "ckpt"
    args = ("run.num_rollout=1", "orchestration.schedule=async", "rollout.max_response_len=8", f"run.save={save}")
    _run(tiny_config(tmp_path / "a", *args))
    threads, rollout_stepped = [], threading.Event()
    step = EngineCore.step

    def watched(self):
        name = threading.current_thread().name
        if name == "miles-async-rollout":
            rollout_stepped.set()
        elif not threads:
            rollout_stepped.wait(timeout=2.0)
        threads.append(name)
        return step(self)

    monkeypatch.setattr(EngineCore, "step", watched)
    records = []
    summary, _ = run_loop(build(tiny_config(tmp_path / "b", *args, "run.resume=true"), MilesPlugins(autoload=False), None),
                          records.append)
    assert summary["status"] == "completed" and summary["eval_accuracy_last"] is not None and records == []
    assert "MainThread" in threads and "miles-async-rollout" not in threads


class PromptSteps:
    @hookimpl
    def miles_after_rollout(self, ctx, step, samples):
        self.steps = getattr(self, "steps", {})
        self.steps[step] = [s.metadata["step"] for s in samples]


@pytest.mark.parametrize("extra", [("run.mode=rollout",), ("train.sft_warmup_steps=1", "train.sft_batch_size=4")])
def test_async_prompts_are_labelled_with_the_step_they_are_drawn_for(tmp_path, extra):
    # the async thread labelled each prompt (metadata.step, saved with the rollouts; the step of its deterministic seed)
    # with the engine's weight version + 1: every prompt of a run.mode=rollout run (no pushes) said step 1, and after an
    # SFT warm-up (version 1 before step 1) every label was one step ahead. A prompt is labelled with the step whose
    # samples were being collected when it was drawn: never past the step that takes it
    cfg = tiny_config(tmp_path, "run.num_rollout=3", "orchestration.schedule=async", "rollout.max_response_len=8",
                      "run.eval_every=100", *extra)
    rec = PromptSteps()
    if "run.mode=rollout" in extra:
        c = build(cfg, MilesPlugins(autoload=False, extra_plugins=[("rec", rec)]), tmp_path / "out")
        c.trainer_factory = None
        run_loop(c, lambda r: None)
    else:
        _run(cfg, rec)
    assert sorted(rec.steps) == [1, 2, 3]
    assert set(rec.steps[1]) == {1}
    assert all(1 <= label <= step for step, labels in rec.steps.items() for label in labels), rec.steps
    # after step 1 took 4 of the 8 groups drawn, the next ones were drawn for step 2: steps 2 and 3 take at least 4
    assert sum(label >= 2 for step in (2, 3) for label in rec.steps[step]) >= 4 * 2
