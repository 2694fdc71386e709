"""A run killed and resumed from its --save folder continues exactly like an uninterrupted one."""

from __future__ import annotations

import pytest

from miles_core.errors import ConfigError
from miles_core.orchestration.build import build
from miles_core.orchestration.checkpoint import find_checkpoint
from miles_core.orchestration.loop import run_loop
from miles_core.plugins.manager import MilesPlugins
from miles_core.testing.contracts import tiny_config

ARGS = ["run.num_rollout=4", "run.eval_every=2", "train.sft_warmup_steps=2", "train.sft_batch_size=4",
        "algorithm.kl_coef=0.05", "train.lr_warmup_steps=1", "train.lr_decay=cosine", "train.max_tokens_per_micro_batch=40"]


class Killed(Exception):
    pass


class DiedInSave(Exception):
    pass


def _run(tmp_path, *extra, kill_at=None):
    cfg = tiny_config(tmp_path, *ARGS, *extra)
    c = build(cfg, MilesPlugins(), tmp_path)
    records = []

    def on_metrics(record):
        if kill_at is not None and record["step"] == kill_at:
            raise Killed
        records.append({k: v for k, v in record.items() if not k.startswith("time_") and k != "rollout_tok_s"})

    try:
        run_loop(c, on_metrics)
    except Killed:
        pass
    return [r for r in records if r["phase"] == "rl"]


def test_killed_and_resumed_run_matches_uninterrupted(tmp_path):
    full = _run(tmp_path / "a")
    save = tmp_path / "save"
    first = _run(tmp_path / "b", f"run.save={save}", "run.save_interval=2", kill_at=3)
    assert [r["step"] for r in first] == [0, 1, 2]
    assert find_checkpoint(save).name == "step_000002"
    second = _run(tmp_path / "c", f"run.save={save}", "run.save_interval=2", f"run.load={save}")
    assert [r["step"] for r in second] == [3, 4]
    assert first + second == full  # every metric, exactly (losses, kl_ref, lr, grad_norm, rewards, eval)
    assert full[-1]["kl_ref"] > 0 and full[1]["lr"] != full[-1]["lr"]


def test_killed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    from miles_core.train.torch_trainer import TorchTrainer

    save = tmp_path / "save"
    _run(tmp_path / "a", f"run.save={save}", "run.save_interval=2", "run.num_rollout=2")
    assert find_checkpoint(save).name == "step_000002"

    def dies(self, path):
        (path / "partial").parent.mkdir(parents=True, exist_ok=True)
        (path / "partial").write_text("half a shard")
        raise DiedInSave

    monkeypatch.setattr(TorchTrainer, "save", dies)
    with pytest.raises(DiedInSave):
        _run(tmp_path / "b", f"run.save={save}", "run.save_interval=1", f"run.load={save}", "run.num_rollout=3")
    assert find_checkpoint(save).name == "step_000002"
    assert not (save / "step_000003").exists()
    monkeypatch.undo()  # the next save, over the killed one's leftover .tmp folder, goes through
    _run(tmp_path / "c", f"run.save={save}", "run.save_interval=1", f"run.load={save}", "run.num_rollout=3")
    assert find_checkpoint(save).name == "step_000003" and not (save / ".tmp-step_000003").exists()


def test_a_step_saved_again_replaces_the_old_folder(tmp_path):
    """Killed between renaming step_000002 into place and moving ``latest`` on: the resumed run (from step 1)
    saves step 2 again over the folder there."""
    save = tmp_path / "save"
    _run(tmp_path / "a", f"run.save={save}", "run.save_interval=1", "run.num_rollout=2")
    (save / "latest").write_text("step_000001")
    (save / "step_000002" / "stale").write_text("from the killed run")
    _run(tmp_path / "b", f"run.save={save}", "run.save_interval=1", f"run.load={save}", "run.num_rollout=2")
    assert find_checkpoint(save).name == "step_000002" and not (save / "step_000002" / "stale").exists()


def test_a_checkpoint_restores_the_rng_states_and_refuses_what_it_cannot_restore(tmp_path):
    import random
    from types import SimpleNamespace

    import torch

    from miles_core.errors import ConfigError
    from miles_core.orchestration.checkpoint import load_checkpoint

    save = tmp_path / "save"
    _run(tmp_path / "a", f"run.save={save}", "run.save_interval=1", "run.num_rollout=1")
    ckpt = find_checkpoint(save)
    trainer = SimpleNamespace(load=lambda path: None)  # the trainer's own state is test_killed_and_resumed's
    draws = []
    for _ in range(2):
        random.random()  # move both generators on
        torch.rand(3)
        state = load_checkpoint(ckpt, trainer, None)
        draws.append((random.random(), torch.rand(3).tolist()))
    assert draws[0] == draws[1] and state.step == 1
    (ckpt / "rng_rank0.pt").unlink()
    with pytest.raises(ConfigError, match="has no rng_rank0.pt; resume with the world size it was saved with"):
        load_checkpoint(ckpt, trainer, None)
    (ckpt / "loop.json").unlink()
    with pytest.raises(ConfigError, match="names 'step_000001', which is not a complete checkpoint"):
        find_checkpoint(save)
    assert find_checkpoint(tmp_path / "nothing-here") is None


def test_a_resumed_run_tells_plugins_of_its_first_weight_push(tmp_path):
    """miles_after_weight_sync follows every push, the one that gives a resumed run's engines the checkpoint's weights too."""
    import json

    from miles_core.hookspecs import hookimpl

    save = tmp_path / "save"
    _run(tmp_path / "a", f"run.save={save}", "run.save_interval=1", "run.num_rollout=1")
    saved = json.loads((find_checkpoint(save) / "loop.json").read_text())["version"]
    synced: list[int] = []

    class Recorder:
        @hookimpl
        def miles_after_weight_sync(self, ctx, version):
            synced.append(version)

    cfg = tiny_config(tmp_path / "b", *ARGS, f"run.save={save}", f"run.load={save}", "run.num_rollout=2")
    run_loop(build(cfg, MilesPlugins(extra_plugins=[("recorder", Recorder())]), tmp_path / "b"), lambda record: None)
    assert synced == [saved, saved + 1]


def _jsonl(path, words):
    import json

    path.write_text("".join(json.dumps({"prompt": f"{w}=", "label": w[::-1]}) + "\n" for w in words))
    return path


def test_a_resume_refuses_a_changed_data_file_unless_told_to_accept_it(tmp_path, caplog):
    """The prompt stream is replayed from the checkpoint's position: over another file that is another order of
    prompts, silently. The checkpoint records the file's size and sha256; a resume compares them."""
    import hashlib
    import json

    from miles_core.errors import DataError

    data = _jsonl(tmp_path / "train.jsonl", ["ab", "abc", "ba", "cab", "bca", "aab"])
    jsonl = ["data.task=jsonl", f"data.train_path={data}", f"data.eval_path={data}"]
    save = tmp_path / "save"
    _run(tmp_path / "a", *jsonl, f"run.save={save}", "run.save_interval=1", "run.num_rollout=1")
    ckpt = find_checkpoint(save)
    saved = json.loads((ckpt / "loop.json").read_text())["data_fingerprint"]
    assert saved == {"path": str(data), "size": data.stat().st_size, "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}

    resume = [*jsonl, f"run.save={save}", "run.resume=true", "run.num_rollout=2"]
    assert [r["step"] for r in _run(tmp_path / "b", *resume)] == [2]  # the same file: resumes
    (save / "latest").write_text(ckpt.name)  # back to step 1

    _jsonl(data, ["ab", "abc", "ba", "cab", "bca", "aab", "bb"])  # a row more: another shuffle
    with pytest.raises(DataError) as err:
        _run(tmp_path / "c", *resume)
    msg = str(err.value)
    assert f"data.train_path '{data}'" in msg and str(ckpt) in msg and "data.allow_changed_on_resume=true" in msg
    assert not list((tmp_path / "c" / "runs").glob("*/metrics.jsonl"))  # refused before anything ran

    with caplog.at_level("WARNING"):
        assert [r["step"] for r in _run(tmp_path / "d", *resume, "data.allow_changed_on_resume=true")] == [2]
    assert "changed since" in caplog.text
    new = json.loads((find_checkpoint(save) / "loop.json").read_text())["data_fingerprint"]
    assert new["size"] == data.stat().st_size and new != saved  # the new checkpoint records the file it read


def test_a_train_only_resume_from_saved_rollouts_does_not_check_the_prompt_file(tmp_path):
    """run.load_rollouts trains on saved samples and draws no prompts: a changed prompt file cannot change what it
    replays, so its resume is not refused."""
    data = _jsonl(tmp_path / "train.jsonl", ["ab", "abc", "ba", "cab", "bca", "aab"])
    jsonl = ["data.task=jsonl", f"data.train_path={data}", f"data.eval_path={data}"]
    save, rollouts = tmp_path / "save", tmp_path / "rollouts"
    _run(tmp_path / "a", *jsonl, f"run.save={save}", "run.save_interval=1", "run.num_rollout=2", f"run.save_rollouts={rollouts}")
    (save / "latest").write_text(find_checkpoint(save).name.replace("2", "1"))  # back to step 1
    _jsonl(data, ["ab", "abc", "ba", "cab", "bca", "aab", "bb"])
    resumed = _run(tmp_path / "b", *jsonl, f"run.save={save}", "run.resume=true", "run.num_rollout=2", f"run.load_rollouts={rollouts}")
    assert [r["step"] for r in resumed] == [2]


def test_a_checkpoint_without_a_data_fingerprint_still_resumes(tmp_path, caplog):
    """Checkpoints saved before Miles recorded the data have no fingerprint: they resume unchecked, with a warning."""
    import json

    data = _jsonl(tmp_path / "train.jsonl", ["ab", "abc", "ba", "cab"])
    jsonl = ["data.task=jsonl", f"data.train_path={data}", f"data.eval_path={data}"]
    save = tmp_path / "save"
    _run(tmp_path / "a", *jsonl, f"run.save={save}", "run.save_interval=1", "run.num_rollout=1")
    loop_json = find_checkpoint(save) / "loop.json"
    old = json.loads(loop_json.read_text())
    del old["data_fingerprint"]
    loop_json.write_text(json.dumps(old))
    _jsonl(data, ["ab", "abc", "ba", "cab", "bb"])
    with caplog.at_level("WARNING"):
        steps = _run(tmp_path / "b", *jsonl, f"run.save={save}", "run.resume=true", "run.num_rollout=2")
    assert [r["step"] for r in steps] == [2]
    assert "records no data fingerprint" in caplog.text


def test_allow_changed_on_resume_is_a_boolean():
    from miles_core.config.loader import load_config
    from miles_core.errors import ConfigError

    assert load_config(None, ["data.allow_changed_on_resume=true"]).data.allow_changed_on_resume is True
    with pytest.raises(ConfigError, match="'data.allow_changed_on_resume' must be true or false"):
        load_config(None, ["data.allow_changed_on_resume=maybe"])


def test_rollout_mode_from_a_checkpoint_labels_samples_with_its_weight_version(tmp_path):
    """run.mode=rollout --resume generates with the checkpoint's weights: samples, records and the summary name their
    version (the checkpoint's), not 0."""
    import json

    from miles_core.hookspecs import hookimpl

    save = tmp_path / "save"
    _run(tmp_path / "a", f"run.save={save}", "run.save_interval=1", "run.num_rollout=2")
    saved = json.loads((find_checkpoint(save) / "loop.json").read_text())["version"]
    assert saved == 3  # the warm-up's push, then one per RL step
    seen: list[set[int]] = []

    class Recorder:
        @hookimpl
        def miles_after_rollout(self, ctx, step, samples):
            seen.append({s.weight_version for s in samples})

    cfg = tiny_config(tmp_path / "b", *ARGS, "run.mode=rollout", f"run.save={save}", "run.resume=true", "run.num_rollout=2")
    records = []
    summary, _ = run_loop(build(cfg, MilesPlugins(extra_plugins=[("recorder", Recorder())]), tmp_path / "b"), records.append)
    assert seen == [{saved}, {saved}]
    assert {r["weight_version"] for r in records} == {saved} and summary["weight_version"] == saved


def test_a_plugin_task_s_changed_data_fingerprint_is_refused_on_resume(tmp_path):
    """``data_fingerprint`` is any JSON-able dict a task sets to identify its data (data/base.py, the tasks hookspec), not
    only the JSONL task's size and sha256: a plugin task whose fingerprint names another revision of its dataset must be
    refused on resume as a changed JSONL file is. The comparison read only ``size`` and ``sha256``, which such a dict
    lacks (None == None), so every change of it resumed silently. Its ``path``, as for JSONL, does not count."""
    import dataclasses

    from miles_core.data.synthetic import addition_factory
    from miles_core.errors import DataError
    from miles_core.hookspecs import hookimpl

    class Versioned:
        @hookimpl
        def miles_register_tasks(self, registry):
            def factory(cfg):
                task = addition_factory(dataclasses.replace(cfg, task_options={}))
                task.data_fingerprint = {"dataset": "sums", "revision": cfg.task_options["revision"],
                                         "path": cfg.task_options.get("path", "sums")}
                return task

            registry.add("versioned", factory)

    def run(out, *extra):
        cfg = tiny_config(out, "data.task=versioned", f"run.save={tmp_path / 'save'}", "run.save_interval=1", *extra)
        records = []
        run_loop(build(cfg, MilesPlugins(extra_plugins=[("versioned", Versioned())]), out), records.append)
        return [r["step"] for r in records if r["phase"] == "rl"]

    run(tmp_path / "a", "data.task_options={revision: 1}", "run.num_rollout=1")
    resume = ["run.resume=true", "run.num_rollout=2"]
    with pytest.raises(DataError, match="resuming would replay another prompt order"):
        run(tmp_path / "b", "data.task_options={revision: 2}", *resume)
    assert run(tmp_path / "c", "data.task_options={revision: 1, path: elsewhere}", *resume) == [2]  # moved: the same data


def test_a_checkpoint_moved_aside_by_a_killed_save_is_put_back(tmp_path):
    """Saving step_N over an older step_N moves the old folder aside before the new one moves in; a kill between the
    two renames left no step_N, and --resume refused the folder as incomplete. The old one is put back and resumed."""
    import os

    save = tmp_path / "save"
    _run(tmp_path / "a", f"run.save={save}", "run.save_interval=1", "run.num_rollout=1")
    ckpt = find_checkpoint(save)
    os.replace(ckpt, ckpt.parent / f".{ckpt.name}.old-12345")  # where replace_dir's first rename leaves it
    assert find_checkpoint(save) == ckpt and (ckpt / "loop.json").is_file()
    assert [r["step"] for r in _run(tmp_path / "b", f"run.save={save}", "run.resume=true", "run.num_rollout=2")] == [2]


def test_a_resumed_ppo_run_continues_its_critic(tmp_path):
    """advantage_estimator=ppo trains a value model beside the policy: a resume continues it (weights and optimizer),
    so that values, advantages and the policy's updates match the uninterrupted run's."""
    reward = tmp_path / "length_reward.py"  # rewards that vary (the tiny model earns no task reward): values to learn
    reward.write_text("def score(sample):\n    return len(sample.response) / 4.0\n")
    ppo = ["algorithm.advantage_estimator=ppo", "algorithm.kl_coef=0.0", f"reward.name={reward}:score"]
    full = _run(tmp_path / "a", *ppo)
    save = tmp_path / "save"
    first = _run(tmp_path / "b", *ppo, f"run.save={save}", "run.save_interval=2", kill_at=3)
    second = _run(tmp_path / "c", *ppo, f"run.save={save}", "run.save_interval=2", f"run.load={save}")
    assert [r["step"] for r in first + second] == [0, 1, 2, 3, 4]
    assert first + second == full
    assert full[-1]["value_loss"] > 0 and full[-1]["adv_std"] > 0


def test_a_resume_trains_with_the_optimizer_settings_it_is_given(tmp_path):
    """Loading the optimizer's state also loaded the weight decay and betas it was saved with: a resume given other
    ones silently went on with the checkpoint's (while a changed train.lr took effect). The config's are used."""
    import torch

    from miles_core.train.critic import Critic

    save = tmp_path / "save"
    _run(tmp_path / "a", f"run.save={save}", "run.save_interval=1", "run.num_rollout=1", "train.sft_warmup_steps=0")
    cfg = tiny_config(tmp_path / "b", *ARGS, f"run.save={save}", "run.resume=true", "run.num_rollout=2",
                      "train.weight_decay=0.25", "train.adam_beta1=0.5", "train.adam_beta2=0.75")
    c = build(cfg, MilesPlugins(), tmp_path / "b")
    _, trainer = run_loop(c, lambda record: None)
    (group,) = trainer.optimizer.param_groups
    assert (group["weight_decay"], group["betas"]) == (0.25, (0.5, 0.75))
    old = Critic(c.model, tiny_config(tmp_path, "algorithm.critic_lr=0.5"), torch.device("cpu"))  # the PPO critic's too
    new = Critic(c.model, cfg, torch.device("cpu"))
    new.load_state_dict(old.state_dict())
    (group,) = new.optimizer.param_groups
    assert (group["lr"], group["weight_decay"], group["betas"]) == (cfg.train.lr, 0.25, (0.5, 0.75))


def test_a_killed_sft_run_resumes_from_its_checkpoint(tmp_path):
    """run.mode=sft wrote no checkpoint (run.save got only the final model, run.save_interval was ignored), so a killed
    SFT run could not be resumed: --resume said the folder holds none. It saves as RL does, and resumes exactly."""
    sft = ["run.mode=sft", "train.sft_batch_size=4", "train.sft_lr=0.01"]

    def run(where, *extra, kill_at=None):
        cfg = tiny_config(tmp_path / where, "run.num_rollout=4", "run.eval_every=2", *sft, *extra)
        records = []

        def on_metrics(record):
            if record["step"] == kill_at:
                raise Killed
            records.append({k: v for k, v in record.items() if not k.startswith("time_")})

        try:
            summary, _ = run_loop(build(cfg, MilesPlugins(), tmp_path / where), on_metrics)
        except Killed:
            summary = None
        return records, summary

    full, full_summary = run("a")
    save = tmp_path / "save"
    first, _ = run("b", f"run.save={save}", "run.save_interval=2", kill_at=3)
    assert find_checkpoint(save).name == "step_000002"
    second, summary = run("c", f"run.save={save}", "run.resume=true")
    assert [r["step"] for r in second] == [3, 4] and first + second == full
    assert summary["eval_accuracy_last"] == full_summary["eval_accuracy_last"]
    with pytest.raises(ConfigError, match="was saved by a run.mode=sft run and cannot be resumed by run.mode=rl"):
        build(tiny_config(tmp_path / "d", f"run.save={save}", "run.resume=true"), MilesPlugins(), None)


def test_what_killed_saves_left_in_the_save_folder_is_removed(tmp_path):
    """A SIGKILL (OOM killer, preemption) during a save leaves its temporary folders: the checkpoint's .tmp-step_N, the
    final model's .hf.tmp-XXXX (atomic_dir), an old step_N moved aside whose replacement is in place. Each can be a
    whole checkpoint, and no later run removed them (.hf.tmp-* and .old-* never; .tmp-step_N only if that very step
    was saved again). The next run on the folder removes them; a folder moved aside without its replacement is put back."""
    import shutil

    save = tmp_path / "save"
    _run(tmp_path / "a", f"run.save={save}", "run.save_interval=1", "run.num_rollout=2")
    for leftover in (".tmp-step_000005", ".step_000001.old-4242"):  # as the kills left them
        shutil.copytree(save / "step_000002", save / leftover)
    for leftover in ("hf", ".hf.tmp-k1ll3d", ".hf.old-4243"):  # the final model's export (orchestration/run.py)
        shutil.copytree(save / "step_000002" / "hf", save / leftover)
    shutil.move(save / "step_000002", save / ".step_000002.old-4244")  # killed between replace_dir's two renames
    assert [r["step"] for r in _run(tmp_path / "b", f"run.save={save}", "run.resume=true", "run.num_rollout=3")] == [3]
    assert sorted(p.name for p in save.iterdir()) == ["hf", "latest", "step_000001", "step_000002", "step_000003"]


def test_resuming_a_finished_run_reports_its_accuracy_not_a_gain_of_zero(tmp_path):
    """--resume of a run whose checkpoint is already at run.num_rollout trains nothing; its summary said the last
    held-out accuracy was the first one (a gain of 0), whatever the run had learnt. The held-out set is scored on the
    checkpoint's weights instead: the same figures as the finished run's. (The reversal task of tests/algorithms/
    test_e2e.py, whose accuracy moves within a few RL steps.)"""
    base = ["run.num_threads=1", "data.task=reverse", "data.num_eval=100",
            "data.task_options={min_len: 2, max_len: 4, alphabet: abcde, demo_noise: 0.5}", "model.hidden_size=128",
            "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=384",
            "rollout.batch_size=32", "rollout.n_samples_per_prompt=8", "rollout.max_response_len=5", "train.sft_warmup_steps=120",
            "train.sft_batch_size=32", "train.sft_lr=0.003", "train.lr=0.002", "train.micro_batch_size=256",
            "run.num_rollout=6", f"run.save={tmp_path / 'ckpt'}", "run.save_interval=6"]
    first, _ = run_loop(build(tiny_config(tmp_path / "a", *base), MilesPlugins(), tmp_path / "a"), lambda r: None)
    assert first["eval_accuracy_last"] != first["eval_accuracy_first"]  # else this test could not tell
    records = []
    again, _ = run_loop(build(tiny_config(tmp_path / "b", *base, "run.resume=true"), MilesPlugins(), tmp_path / "b"), records.append)
    assert [r for r in records if r["phase"] == "rl"] == []
    for key in ("eval_accuracy_first", "eval_accuracy_last", "eval_accuracy_gain", "weight_version"):
        assert again[key] == pytest.approx(first[key]), key


def test_an_sft_resume_refuses_a_changed_example_file(tmp_path):
    """An SFT checkpoint's position in its example stream (data.train_path's pairs, reshuffled with the seed) is exact
    only over the file it was saved with; SFT checkpoints recorded no fingerprint, so an edited file resumed silently
    from another order. Refused as RL's resume is, unless data.allow_changed_on_resume accepts it."""
    from miles_core.errors import DataError

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "response": "a{i}"}}\n' for i in range(8)))
    sft = ["run.mode=sft", "train.sft_batch_size=4", f"data.train_path={data}", f"run.save={tmp_path / 'save'}",
           "run.save_interval=1"]
    run_loop(build(tiny_config(tmp_path / "a", "run.num_rollout=1", *sft), MilesPlugins(), tmp_path / "a"), lambda r: None)
    resume = [*sft, "run.num_rollout=2", "run.resume=true"]
    build(tiny_config(tmp_path / "b", *resume), MilesPlugins(), None)  # the same file: accepted
    data.write_text(data.read_text().replace("a3", "a33"))
    with pytest.raises(DataError, match=r"data.train_path '.*pairs.jsonl' changed since checkpoint"):
        build(tiny_config(tmp_path / "b", *resume), MilesPlugins(), None)
    build(tiny_config(tmp_path / "b", *resume, "data.allow_changed_on_resume=true"), MilesPlugins(), None)
