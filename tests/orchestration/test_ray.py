"""A real local Ray cluster on CPU: 2 engine actors + 1 trainer actor give the metrics of local mode."""

import os
import shutil
import tempfile
import time

import pytest

from miles_core.errors import ConfigError, MilesUserError
from miles_core.orchestration.build import build
from miles_core.orchestration.loop import run_loop
from miles_core.orchestration.placement import make_placement
from miles_core.plugins.manager import MilesPlugins
from miles_core.testing.contracts import tiny_config

ray = pytest.importorskip("ray")

KEYS = ("reward_mean", "loss", "grad_norm", "approx_kl", "entropy", "adv_std", "mismatch_kl", "response_len", "eval_accuracy", "eval_reward")


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback, not the machine's external address
    tmp = tempfile.mkdtemp(prefix="miles-ray-t")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    yield
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def _metrics(tmp_path, *overrides):
    cfg = tiny_config(
        tmp_path, "run.num_rollout=3", "run.num_threads=1", "orchestration.deterministic=true",
        "reward.name=orch_rewards:digit_share", "rollout.max_response_len=6", "train.lr=1e-2", *overrides,
    )
    records = []
    summary, _ = run_loop(build(cfg, MilesPlugins(autoload=False), None), records.append)
    assert summary["status"] == "completed" and summary["weight_version"] == 3
    return [r for r in records if r["step"] > 0]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The local-mode run that every Ray placement is compared with (deterministic: run once)."""
    return _metrics(tmp_path_factory.mktemp("local"))


def test_ray_two_engines_match_local_mode(tmp_path, ray_cluster, local):
    assert len({r["reward_mean"] for r in local}) > 1 and all(r["loss"] != 0 for r in local)  # a real signal, not zeros
    on_ray = _metrics(tmp_path, "orchestration.placement=ray_disaggregated", "orchestration.num_engines=2")
    for a, b in zip(local, on_ray, strict=True):
        for key in KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])  # exact: same seeds, same kernels, 1 thread


def test_ray_colocated_releases_and_reloads_the_engine(tmp_path, ray_cluster, local):
    colocated = _metrics(tmp_path, "orchestration.placement=ray_colocated")
    assert [r["loss"] for r in colocated] == [r["loss"] for r in local]
    assert [r["weight_version"] for r in colocated] == [1, 2, 3]


def test_colocated_engines_hold_no_memory_while_the_trainer_works(tmp_path, ray_cluster):
    cfg = tiny_config(tmp_path, "orchestration.placement=ray_colocated", "orchestration.num_engines=2")
    placement = make_placement(build(cfg, MilesPlugins(autoload=False), None))
    try:
        released = lambda: ray.get([e.released.remote() for e in placement.backend.engines])  # noqa: E731
        assert released() == [[], []]
        with placement.training():
            assert released() == [["kv_cache", "weights"]] * 2
        assert released() == [[], []]
    finally:
        placement.close()


def test_two_trainer_ranks_on_ray_match_one_rank(tmp_path, ray_cluster, local):
    """FSDP2 over two trainer actors (gloo) gives one rank's first step (same global batch), and the
    run goes on with the weights gathered from both ranks."""
    two = _metrics(tmp_path, "orchestration.placement=ray_disaggregated", "orchestration.trainer_num_ranks=2")
    for key in ("reward_mean", "loss", "grad_norm", "approx_kl", "entropy", "adv_std"):
        assert two[0][key] == pytest.approx(local[0][key], rel=1e-4, abs=1e-6), key  # same samples; sums split across ranks
    assert [r["weight_version"] for r in two] == [1, 2, 3]
    assert two[-1]["loss"] == pytest.approx(local[-1]["loss"], rel=1e-2, abs=1e-4)
    cfg = tiny_config(tmp_path, "orchestration.placement=ray_disaggregated", "orchestration.trainer_num_ranks=2")
    placement = make_placement(build(cfg, MilesPlugins(autoload=False), None))
    try:
        assert ray.get([a.rank_and_world.remote() for a in placement.trainer.actors]) == [(0, 2), (1, 2)]
    finally:
        placement.close()


def _pg_states() -> list[str]:
    from ray.util import placement_group_table

    return [pg["state"] for pg in placement_group_table().values()]


def test_resources_the_cluster_lacks_are_one_clear_error(tmp_path, ray_cluster):
    # a bundle the cluster can never grant (a GPU on a CPU cluster) waited 120 s for the placement group, then raised
    # Ray's GetTimeoutError
    cfg = tiny_config(tmp_path, "orchestration.placement=ray_disaggregated", "orchestration.engine_num_gpus=1")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"1 GPU.*orchestration\.engine_num_gpus"):
        make_placement(build(cfg, MilesPlugins(autoload=False), None))
    assert time.monotonic() - t0 < 10 and "CREATED" not in _pg_states()


def test_a_user_error_in_an_engine_actor_is_raised_as_itself(tmp_path, ray_cluster):
    # the engine actor's backend refuses the config (here a URL nothing answers): the actor died in its constructor and
    # the run ended on a RayActorError traceback at the first generate (exit 1), and again from close(), which then
    # skipped removing the placement group and the Ray temp folder
    cfg = tiny_config(tmp_path, "orchestration.placement=ray_disaggregated", "rollout.backend=sglang",
                      "rollout.sglang.urls=[http://127.0.0.1:9]")
    with pytest.raises(MilesUserError, match=r"^rollout.sglang.urls: http://127.0.0.1:9 does not answer /health"):
        placement = make_placement(build(cfg, MilesPlugins(autoload=False), None))
        placement.close()
    assert "CREATED" not in _pg_states()


def test_closing_after_an_engine_actor_died_cleans_up(tmp_path, ray_cluster):
    # an engine actor that died mid-run (Ray's OOM killer, a crash): the run's error was replaced by another from
    # close() (RayBackend.shutdown called the dead actor), which then skipped the placement group, Ray and its temp folder
    cfg = tiny_config(tmp_path, "orchestration.placement=ray_disaggregated", "run.mode=rollout")  # one engine actor, no trainer
    placement = make_placement(build(cfg, MilesPlugins(autoload=False), None))
    closed = []
    placement._close.append(lambda: closed.append(True))
    ray.kill(placement.backend.engines[0])
    placement.close()
    assert closed and "CREATED" not in _pg_states()


def test_a_user_error_in_an_actor_call_keeps_its_one_line(tmp_path, ray_cluster):
    # a plugin's policy loss runs in the trainer actor: its PluginError reached the driver as Ray's RayTaskError, whose
    # message is the remote traceback ('ray::TrainerWorker.call() (pid=...)', file lines, then the error), so the CLI's
    # one line was a traceback
    from miles_core.errors import PluginError
    from miles_core.hookspecs import hookimpl

    def nan_loss(inputs, cfg):
        raise ValueError("the loss is nan")

    class Losses:
        @hookimpl
        def miles_register_policy_losses(self, registry):
            registry.add("nan_loss", nan_loss)

    cfg = tiny_config(tmp_path, "orchestration.placement=ray_disaggregated", "run.num_rollout=1", "algorithm.policy_loss=nan_loss")
    c = build(cfg, MilesPlugins(autoload=False, extra_plugins=[("lossy", Losses())]), None)
    with pytest.raises(PluginError) as info:
        run_loop(c, lambda record: None)
    assert str(info.value) == "policy loss 'nan_loss' (plugin 'lossy') raised ValueError: the loss is nan"
    assert type(info.value) is PluginError and "CREATED" not in _pg_states()


class _Killed(Exception):
    pass


def _resumable(tmp_path, *overrides, kill_at=None):
    cfg = tiny_config(tmp_path, "run.num_rollout=3", "run.num_threads=1", "rollout.max_response_len=6", "train.lr=1e-2",
                      "reward.name=orch_rewards:digit_share",
                      "orchestration.placement=ray_disaggregated", *overrides)
    records = []

    def on_metrics(record):
        if record["step"] == kill_at:
            raise _Killed
        records.append(record)

    try:
        run_loop(build(cfg, MilesPlugins(autoload=False), None), on_metrics)
    except _Killed:
        pass
    return [(r["step"], r["reward_mean"], r["loss"]) for r in records if r["step"] > 0]


def test_a_resumed_ray_run_draws_the_samples_of_an_uninterrupted_one(tmp_path, ray_cluster):
    # a checkpoint saved only the driver's RNG states: each engine actor's generator of sampling seeds was not saved,
    # so a resumed run restarted it from run.seed and sampled other responses than the run it continues
    save = tmp_path / "save"
    full = _resumable(tmp_path / "a")
    first = _resumable(tmp_path / "b", f"run.save={save}", "run.save_interval=1", kill_at=3)
    second = _resumable(tmp_path / "c", f"run.save={save}", f"run.load={save}")
    assert [r[0] for r in first + second] == [1, 2, 3]
    assert len({r[1] for r in full}) > 1  # the steps sample differently: a real signal
    assert first + second == full
