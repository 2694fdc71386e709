"""Engines and the trainer as Ray actors in one placement group, behind the loop's usual interfaces.

* :class:`EngineWorker` / :class:`TrainerWorker` run inside the actors: each builds its own
  plugin manager and :class:`RunContext` from the pickled config and model, then the registered
  backend (``rollout.backend``) or trainer (``train.backend``), exactly as local mode does.
* :class:`RayBackend` spreads a ``generate`` call over the engines: the prompts are cut into
  contiguous chunks, one per engine (a prompt's group of ``n`` stays on one engine), and the
  results are put back in prompt order with batch-wide group ids and indices.
* :class:`RayTrainer` forwards the trainer calls to every trainer rank at once
  (``orchestration.trainer_num_ranks``; with several, the actors form one torch.distributed group,
  rank 0 as the rendezvous, and the torch trainer shards the model with FSDP2 across them: each
  rank gets the same global batch and takes its share). ``weights()`` returns a Ray object reference:
  the trainer actor puts its state dict in the object store once, and every engine actor gets it
  from there (``RayBackend.update_weights``), tagged with the version.

Bundles: disaggregated, one per engine (``engine_num_cpus``/``engine_num_gpus``) and one for the
trainer; colocated, one bundle holding all of them, its GPUs shared (each actor asks for an equal
fraction), the engines releasing memory while the trainer works (:class:`Placement`).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch

from miles_core.errors import ConfigError, MilesUserError

log = logging.getLogger(__name__)


def _actor_context(cfg, blocked, tokenizer, num_threads: int):
    from miles_core.context import RunContext
    from miles_core.kernels.base import Kernels
    from miles_core.platforms import select_platform
    from miles_core.plugins.manager import MilesPlugins

    torch.set_num_threads(num_threads)
    torch.manual_seed(cfg.run.seed)
    plugins = MilesPlugins(blocked=blocked)
    platform, device = select_platform(plugins.registries.platforms, cfg.run.device)
    return RunContext(cfg, plugins, tokenizer, device, platform.name, Kernels(plugins, platform.name), None)


def _get(refs):
    """``ray.get(refs)``; a user error raised in an actor (a plugin's loss, a data error in an engine) comes out as
    itself: Ray's RayTaskError is an instance of it too, but its message is the remote traceback, which the CLI
    would print as its one line."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, MilesUserError):
            raise exc.cause from exc
        raise


class _Started:
    """A user error in an actor's constructor (a URL nothing answers, a plugin's ConfigError) is kept and handed to
    the driver by :meth:`failed`, which raises it as itself: raised in the constructor, it kills the actor, and
    the driver sees only a RayActorError traceback at its first call."""

    error: MilesUserError | None = None

    def failed(self) -> MilesUserError | None:
        return self.error


class EngineWorker(_Started):
    def __init__(self, cfg, blocked, tokenizer, model, num_threads: int) -> None:
        try:
            ctx = _actor_context(cfg, blocked, tokenizer, num_threads)
            factory = ctx.plugins.registries.rollout_backends.get(cfg.rollout.backend, key="rollout.backend")
            self.engine = factory(ctx, model)
        except MilesUserError as exc:
            self.error = exc

    def generate(self, prompts, params, n):
        return self.engine.generate(prompts, params, n)

    def update_weights(self, state_dict, version: int) -> int:
        self.engine.update_weights(state_dict, version)
        return self.engine.weight_version

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def get_rng_state(self) -> object:
        """The engine's generator of sampling seeds (checkpoints); None for an engine without one."""
        get = getattr(self.engine, "get_rng_state", None)
        return None if get is None else get()

    def set_rng_state(self, state: object) -> None:
        if state is not None:
            self.engine.set_rng_state(state)

    def released(self) -> list[str]:
        """What the engine has given back (built-in engine: 'kv_cache', 'weights')."""
        return sorted(getattr(getattr(self.engine, "core", None), "released", ()))

    def shutdown(self) -> None:
        if self.error is None:  # else there is no engine
            self.engine.shutdown()


class TrainerWorker(_Started):
    def __init__(self, cfg, blocked, tokenizer, model, num_threads: int, rank: int = 0, world: int = 1, master: str = "") -> None:
        if world > 1:  # the environment torchrun would set; init_from_env joins the group
            addr, port = master.rsplit(":", 1)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR=addr, MASTER_PORT=port)
        try:
            ctx = _actor_context(cfg, blocked, tokenizer, num_threads)
            self.trainer = ctx.plugins.registries.trainers.get(cfg.train.backend, key="train.backend")(ctx, model)
        except MilesUserError as exc:
            self.error = exc

    def call(self, name: str, *args, **kwargs):
        return getattr(self.trainer, name)(*args, **kwargs)

    def rank_and_world(self) -> tuple[int, int]:
        d = getattr(self.trainer, "dist", None)
        return (d.rank, d.world_size) if d is not None else (0, 1)

    def weights_ref(self) -> list:
        import ray

        weights = self.trainer.weights()  # under FSDP a collective: every rank gathers
        if getattr(getattr(self.trainer, "dist", None), "rank", 0) != 0:
            return [None]
        return [ray.put({k: v.cpu() for k, v in weights.items()})]  # in a list: the caller gets the ref

    @staticmethod
    def free_address() -> str:
        """host:port for the trainer ranks' rendezvous (asked of rank 0's actor, on its node)."""
        import ray

        from miles_core.rollout.sglang.launch import free_port

        return f"{ray.util.get_node_ip_address()}:{free_port('')}"


class RayBackend:
    def __init__(self, engines: list) -> None:
        self.engines = engines
        self.weight_version = 0

    def generate(self, prompts, params, n: int = 1):
        k = len(self.engines)
        bounds = [len(prompts) * i // k for i in range(k + 1)]
        chunks = [(bounds[i], prompts[bounds[i] : bounds[i + 1]]) for i in range(k)]
        refs = [(start, e.generate.remote(chunk, params, n)) for e, (start, chunk) in zip(self.engines, chunks) if chunk]
        out = []
        for start, ref in refs:
            for s in _get(ref):
                s.group_id += start
                s.index = len(out)
                out.append(s)
        return out

    def update_weights(self, state_dict, version: int) -> None:
        import ray

        ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(dict(state_dict))
        held = _get([e.update_weights.remote(ref, version) for e in self.engines])
        assert held == [version] * len(self.engines), held
        self.weight_version = version

    def get_rng_states(self) -> list:
        """Each engine actor's sampling state, saved in checkpoints so that a resumed run samples as the run it
        continues (the driver's own RNG states draw no sampling seeds here)."""
        return _get([e.get_rng_state.remote() for e in self.engines])

    def set_rng_states(self, states: list) -> None:
        if len(states) != len(self.engines):
            log.warning("the checkpoint holds the sampling states of %d engine actors, not of %d (orchestration.num_engines): "
                        "the resumed run's samples start from run.seed", len(states), len(self.engines))
            return
        _get([e.set_rng_state.remote(s) for e, s in zip(self.engines, states)])

    def release_memory(self) -> None:
        _get([e.release_memory.remote() for e in self.engines])

    def resume_memory(self) -> None:
        _get([e.resume_memory.remote() for e in self.engines])

    def shutdown(self) -> None:
        """Shut the live engines down; a dead one (killed for memory, crashed) has nothing left to stop."""
        import ray

        for ref in [e.shutdown.remote() for e in self.engines]:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass


class RayTrainer:
    on_policy_old_logprobs = True  # train_step accepts batch.old_logprobs=None (Trainer.train_step)

    def __init__(self, actors: list) -> None:
        self.actors = actors

    def _call(self, name, *args, **kwargs):
        """Call on every rank at once (the calls hold collectives); rank 0's result."""
        return _get([a.call.remote(name, *args, **kwargs) for a in self.actors])[0]

    def compute_logprobs(self, batch, temperature=None):
        return self._call("compute_logprobs", batch, temperature)

    def compute_ref_logprobs(self, batch, temperature=None):
        return self._call("compute_ref_logprobs", batch, temperature)

    def train_step(self, batch, loss_fn, temperature=None, lr=None):
        return self._call("train_step", batch, loss_fn, temperature, lr)

    def reset_reference(self) -> None:
        self._call("reset_reference")

    def weights(self):
        return _get([a.weights_ref.remote() for a in self.actors])[0][0]

    def save(self, path: Path) -> None:
        self._call("save", path)

    def load(self, path: Path) -> None:
        self._call("load", path)

    def export_hf(self, family, dest: Path, extra_files=None) -> None:
        self._call("export_hf", family, dest, extra_files)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}


def _check_fits(bundles: list[dict[str, float]], have: dict[str, float]) -> None:
    """Refuse bundles the cluster can never grant (Ray would wait for the placement group without end)."""
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v
    short = [f"{need[k]:g} {k}" for k in need if need[k] > have.get(k, 0.0)]
    if short:
        total = ", ".join(f"{have.get(k, 0.0):g} {k}" for k in need)
        raise ConfigError(f"the Ray placement asks for {', '.join(short)} in all, and the cluster has {total}: lower "
                          f"orchestration.engine_num_gpus / trainer_num_gpus / *_num_cpus (or num_engines, trainer_num_ranks)")


def _check_started(actors: list) -> None:
    """Wait for the actors' constructors; the first user error among them is raised as itself."""
    import ray

    refs = [a.failed.remote() for a in actors]
    while refs:  # in the order they finish: a rank waiting for a failed rank's rendezvous never does
        done, refs = ray.wait(refs, num_returns=1)
        error = ray.get(done[0])
        if error is not None:
            raise error


def _check_answers(address: str) -> None:
    """Ray tries an address nothing answers for minutes (20 tries of ~35 s) before its ConnectionError."""
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        return  # 'auto', 'local': Ray finds (or starts) the cluster itself, and fails at once if it cannot
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers there ({exc}): start the cluster (ray start --head) or leave "
                              f"orchestration.ray_address unset to start one here") from None


def _init_ray(ray, o) -> list:
    """Connect to ``orchestration.ray_address``, or start a local cluster; what closes it."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind to loopback, not the external address
    if o.ray_address:
        try:
            _check_answers(o.ray_address)
            ray.init(address=o.ray_address, include_dashboard=False, log_to_driver=False)
        except ConnectionError as exc:
            raise MilesUserError(f"orchestration.ray_address={o.ray_address}: {exc}") from None
        return [ray.shutdown]
    tmp = tempfile.mkdtemp(prefix="miles-ray-")
    need = o.num_engines * o.engine_num_cpus + o.trainer_num_ranks * o.trainer_num_cpus
    try:
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(int(need + 0.999), os.cpu_count() or 1), _temp_dir=tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [ray.shutdown, lambda: shutil.rmtree(tmp, ignore_errors=True)]


def ray_placement(c, need_trainer: bool, need_backend: bool):
    try:
        import ray
    except ImportError:
        raise ConfigError("orchestration.placement=ray_* needs Ray: pip install 'miles[ray]'") from None
    o = c.ctx.config.orchestration
    closers = []
    if not ray.is_initialized():
        closers = _init_ray(ray, o)
    try:
        return _place(c, ray, o, need_trainer, need_backend, closers)
    except BaseException:  # nothing is left behind: the placement group, a Ray cluster started here, its temp folder
        for fn in closers:
            fn()
        raise


def _place(c, ray, o, need_trainer: bool, need_backend: bool, closers: list):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles_core.orchestration.placement import Placement

    cfg = c.ctx.config
    colocated = o.placement == "ray_colocated"
    n_eng = o.num_engines if need_backend else 0
    if colocated:
        bundles = [_bundle(n_eng * o.engine_num_cpus + o.trainer_num_cpus, max(o.engine_num_gpus, o.trainer_num_gpus))]
        share = max(o.engine_num_gpus, o.trainer_num_gpus) / (n_eng + int(need_trainer))
        eng_res = [(0, o.engine_num_cpus, share)] * n_eng
        tr_res = (0, o.trainer_num_cpus, share)
    else:
        ranks = o.trainer_num_ranks
        bundles = [_bundle(o.engine_num_cpus, o.engine_num_gpus)] * n_eng + [_bundle(o.trainer_num_cpus, o.trainer_num_gpus)] * ranks
        eng_res = [(i, o.engine_num_cpus, o.engine_num_gpus) for i in range(n_eng)]
        tr_res = (n_eng, o.trainer_num_cpus, o.trainer_num_gpus)
    _check_fits(bundles, ray.cluster_resources())
    pg = placement_group(bundles, strategy="PACK")
    closers.insert(0, lambda: remove_placement_group(pg))
    try:
        ray.get(pg.ready(), timeout=120)
    except ray.exceptions.GetTimeoutError:
        raise MilesUserError(f"the Ray cluster did not grant the placement group {bundles} within 120 s "
                             f"(free now: {ray.available_resources()}); other jobs may hold its resources") from None

    def spawn(cls, res, *extra):
        index, cpus, gpus = res
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        threads = cfg.run.num_threads or max(1, int(cpus))
        actor_cls = ray.remote(cls).options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy)
        return actor_cls.remote(cfg, c.ctx.plugins.blocked, c.ctx.tokenizer, c.model, threads, *extra)

    engines = [spawn(EngineWorker, r) for r in eng_res]
    trainer = None
    if need_trainer:
        world = 1 if colocated else o.trainer_num_ranks
        master = ""
        if world > 1:  # the rendezvous address is taken where rank 0 will run
            index = tr_res[0]
            probe = ray.remote(TrainerWorker.free_address).options(
                num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index))
            master = ray.get(probe.remote())
        trainer = RayTrainer([spawn(TrainerWorker, (tr_res[0] + r, *tr_res[1:]), r, world, master) for r in range(world)])
    try:
        _check_started(engines + (trainer.actors if trainer is not None else []))
    except BaseException:  # servers the live engines launched run in their own sessions: they would outlive their actors
        RayBackend(engines).shutdown()
        raise
    backend = RayBackend(engines) if engines else None
    return Placement(trainer, backend, colocated=colocated, _close=closers)
