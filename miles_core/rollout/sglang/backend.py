"""The ``sglang`` rollout backend: a client of SGLang-protocol servers (SGLang or `miles serve`).

It connects to ``rollout.sglang.urls`` or launches ``rollout.sglang.num_engines`` servers (see
:mod:`.launch`). ``generate`` sends one ``/generate`` request per prompt group (``input_ids``,
``sampling_params`` with ``n``, ``return_logprob``), so a group's samples share the prompt's KV on
one engine; groups go round-robin over the engines, all at once from a thread pool. Answers are
read as SGLang's ``meta_info`` (``output_token_logprobs`` = ``[logprob, token_id, text]``
triples, ``finish_reason.type``, ``weight_version``) and turned into :class:`Sample` exactly as
:class:`BuiltinEngine` makes them.

Launched engines are watched by :class:`EngineMonitor`: a dead one is relaunched, given the last
pushed weights, and the groups that were in flight on it are sent again (to it or another
engine). A group's samples come only from one successful answer, so each sample is returned
exactly once. ``abort_all()`` (from another thread) makes a running ``generate`` return what it
has: in-flight requests come back with their partial tokens and ``finish_reason="abort"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import MilesUserError
from miles_core.orchestration.recovery import EngineMonitor
from miles_core.orchestration.seeds import SEED_KEY
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import trim_stop
from miles_core.rollout.sglang.config import SglangConfig
from miles_core.rollout.sglang.http import EngineDown, healthy, request
from miles_core.rollout.sglang.launch import LaunchedServer, launch, resolve_launcher, wait_healthy
from miles_core.rollout.sglang.protocol import generate_body, parse_output
from miles_core.types import Prompt, Sample


@dataclass
class Engine:
    index: int
    url: str
    server: LaunchedServer | None = None  # None: a server given by URL (not ours to restart)
    up: threading.Event | None = None
    restarts: int = 0

    def dead(self) -> bool:
        return self.server is not None and not self.server.alive()


class SglangBackend:
    def __init__(self, cfg: SglangConfig, tokenizer, model_dir: str | Path, workdir: str | Path, vocab_size: int | None = None,
                 temporary_workdir: bool = False) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size  # the trainer's model's: an engine's ids must be below it
        self.model_dir = str(model_dir)
        self.workdir = Path(workdir)
        self.temporary_workdir = temporary_workdir  # shutdown() removes the workdir (made for this backend alone)
        self.weight_version = 0
        self.weights_lock = threading.RLock()  # held by a push and by a restart's weight load
        self._latest_path: str | None = None  # the folder holding the last pushed version
        self._latest_state: Mapping[str, torch.Tensor] | None = None  # or the tensors themselves
        self._abort = threading.Event()
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._calls = 0
        self.monitor: EngineMonitor | None = None
        self.kind = "external"
        # engines given by URL may hold any weights at the start, whatever version they report: the loop pushes the
        # trainer's before the first rollout (a server of another architecture then fails that push, by name)
        self.foreign_weights = bool(cfg.urls)
        self.run_extras: dict | None = None  # the run's ctx.extras; shutdown() adds "summary" there
        self._servers: list[LaunchedServer] = []  # every server launched, for shutdown() (a restart's too)
        self._closing = threading.Event()  # set by shutdown(): no server is launched from then on
        self._launch_lock = threading.Lock()
        if cfg.urls:
            self.engines = [Engine(i, u.rstrip("/"), None, _set_event()) for i, u in enumerate(cfg.urls)]
            for e in self.engines:
                if not healthy(e.url, timeout=5.0):
                    raise MilesUserError(f"rollout.sglang.urls: {e.url} does not answer /health (is the server running?)")
            self.weight_version = max(self._reported_versions())
            return
        self.kind = resolve_launcher(cfg.launcher)
        servers = [self._launch(i) for i in range(cfg.num_engines)]
        try:
            for s in servers:
                wait_healthy(s, cfg.startup_timeout_s)
        except BaseException:
            for s in servers:
                s.stop()
            raise
        self.engines = [Engine(i, s.url, s, _set_event()) for i, s in enumerate(servers)]
        if cfg.recover:
            self.monitor = EngineMonitor(len(self.engines), lambda i: not self.engines[i].dead(), self._restart,
                                         cfg.health_interval_s, cfg.max_restarts)
            self.monitor.start()

    # ------------------------------------------------------------------ engines
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def post(self, url: str, path: str, body: Any, timeout: float | None = None) -> Any:
        return request(url + path, body, timeout or self.cfg.request_timeout_s)

    def _reported_versions(self) -> list[int]:
        out = []
        for e in self.engines:
            try:
                info = request(e.url + "/model_info", timeout=30)  # SGLang >= 0.5.23; /get_model_info before
            except MilesUserError as exc:
                if "HTTP 404" not in str(exc):
                    raise
                info = request(e.url + "/get_model_info", timeout=30)
            v = info.get("weight_version") if isinstance(info, dict) else None
            try:
                out.append(int(v) if v not in (None, "default") else 0)
            except (TypeError, ValueError):
                raise MilesUserError(f"{e.url}/model_info: field 'weight_version' is {v!r}, not an integer") from None
        return out

    def engine_versions(self) -> list[int]:
        """The weight version each engine reports (``/get_model_info``)."""
        return self._reported_versions()

    def _launch(self, i: int) -> LaunchedServer:
        """Start engine ``i``'s server, on the list that shutdown() stops: a restart's new server may still be loading
        then (minutes for a large model), and would run on in its own session."""
        with self._launch_lock:
            if self._closing.is_set():
                raise MilesUserError("the rollout backend is shutting down: no engine is restarted")
            server = launch(self.kind, self.model_dir, self.cfg.server_args, self.workdir / "logs", f"engine{i}")
            self._servers.append(server)
        return server

    def _restart(self, i: int) -> None:
        """Relaunch engine ``i`` and load the last pushed weights into it (the monitor calls this)."""
        eng = self.engines[i]
        eng.up.clear()
        old = eng.server
        old.stop()
        with self.weights_lock:
            for attempt in range(3):  # the new process may die too (killed while starting)
                server = self._launch(i)
                try:
                    wait_healthy(server, self.cfg.startup_timeout_s)
                    break
                except MilesUserError:
                    server.stop()
                    if attempt == 2:
                        raise
            if self.weight_version:
                path = self._latest_path or self._write_latest()
                request(server.url + "/update_weights_from_disk", {"model_path": path, "weight_version": str(self.weight_version)},
                        self.cfg.request_timeout_s)
            eng.server, eng.url = server, server.url
            eng.restarts += 1
        eng.up.set()

    def _write_latest(self) -> str:
        from safetensors.torch import save_file

        from miles_core.models.checkpoint import atomic_dir

        dest = self.workdir / "recovery_weights"
        state = {k: v.detach().to("cpu").contiguous() for k, v in self._latest_state.items()}
        atomic_dir(dest, lambda tmp: save_file(state, str(tmp / "model.safetensors")))
        self._latest_path = str(dest)
        return self._latest_path

    # ------------------------------------------------------------------ weights
    def remember(self, version: int, path: str | None = None, state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Record a pushed version and where a restarted engine can load it from."""
        self.weight_version = version
        self._latest_path = path
        self._latest_state = None if state is None else {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def recovering(self, url: str) -> bool:
        """Whether ``url`` belongs to a launched engine that died (the monitor restarts it)."""
        return self.monitor is not None and any(e.url == url and (e.dead() or not e.up.is_set()) for e in self.engines)

    def wait_all_up(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s + 60
        while any(e.dead() or not e.up.is_set() for e in self.engines):
            failed = self.monitor.failures if self.monitor is not None else {}
            if failed or time.monotonic() > deadline:
                raise MilesUserError(f"rollout engines did not come back: {failed or 'timed out'}")
            time.sleep(0.05)

    def broadcast_post(self, path: str, body: Any) -> None:
        """POST ``body`` to every engine; one that dies meanwhile is skipped (its restart loads the
        version recorded by :meth:`remember`, which the caller does before releasing weights_lock)."""
        def one(url):
            try:
                res = self.post(url, path, body)
            except EngineDown:
                if self.recovering(url) or (self.monitor is not None and not healthy(url)):
                    return
                raise MilesUserError(f"{url}{path}: the rollout server stopped answering") from None
            if isinstance(res, dict) and res.get("success") is False:
                raise MilesUserError(f"{url}{path}: {res.get('message', res)}")

        with ThreadPoolExecutor(len(self.engines)) as pool:
            list(pool.map(one, self.engine_urls()))

    def update_weights_from_disk(self, path: str | Path, version: int) -> None:
        with self.weights_lock:
            self.broadcast_post("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)})
            self.remember(version, path=str(path))

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """The in_process transport's call: over HTTP this goes through a safetensors folder."""
        from miles_core.sync.disk import write_weights

        path = write_weights(state_dict, self.workdir / "weights", version, self.model_dir)
        self.update_weights_from_disk(path, version)

    def release_memory(self) -> None:
        """``ray_colocated``: the engines free their KV cache and weights while the trainer works
        (``/release_memory_occupation``; SGLang servers need ``--enable-memory-saver``)."""
        self.broadcast_post("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self.broadcast_post("/resume_memory_occupation", {})

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[Sample]:
        self._abort.clear()
        self._calls += 1
        call = self._calls
        ids = [p.prompt_ids or self.tokenizer.encode(p.text) for p in prompts]
        seeds = [p.metadata.get(SEED_KEY) for p in prompts]  # deterministic mode (miles_core.orchestration.seeds)
        pool = ThreadPoolExecutor(max(1, min(len(prompts), 64)), thread_name_prefix="miles-sglang")
        try:
            futures = [pool.submit(self._group, gi, ids[gi], params if seeds[gi] is None else dataclasses.replace(params, seed=seeds[gi]), n)
                       for gi in range(len(prompts))]
            answers = [f.result() for f in futures]
        except BaseException:
            # a group failed, or Ctrl-C / SIGTERM: the other groups may run for minutes; waiting for them kept the run
            # from stopping its engines (past a scheduler's grace period, SIGKILL then leaves them running)
            self._abort.set()
            self._abort_engines(timeout=2.0)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        samples: list[Sample] = []
        for gi, (prompt, (eng, attempts, outs)) in enumerate(zip(prompts, answers)):
            for j, (out_ids, lps, reason, version) in enumerate(outs):
                samples.append(self._sample(prompt, ids[gi], out_ids, lps, reason, version, params, gi, len(samples),
                                            {"sample_id": f"{call}:{gi}:{j}", "engine": eng, "attempts": attempts}))
        return samples

    def _sample(self, prompt, prompt_ids, out_ids, lps, reason, version, params, gi, index, extra) -> Sample:
        stop = set(params.stop_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and not params.ignore_eos:
            stop.add(eos)
        text = self.tokenizer.decode([t for t in out_ids if t not in stop])
        return Sample(
            prompt=prompt.text, prompt_ids=list(prompt_ids), response_ids=out_ids,
            response=trim_stop(text, params.stop) if params.stop else text, rollout_logprobs=lps, label=prompt.label,
            group_id=gi, index=index, finish_reason=reason,
            weight_version=self.weight_version if version is None else version,
            metadata={**prompt.metadata, **extra},
        )

    def _group(self, gi: int, prompt_ids: list[int], params: SamplingParams, n: int):
        """(engine index, attempts, n parsed answers) for one prompt group; resubmits after a crash."""
        body = generate_body(prompt_ids, params, n)
        attempts = drops = 0
        eng = self.engines[gi % len(self.engines)]
        while True:
            if self._abort.is_set():  # never sent (or lost with a dead engine): aborted with no tokens
                return eng.index, attempts, [([], [], "abort", None)] * n
            attempts += 1
            url = eng.url
            try:
                with self._track():
                    out = request(url + "/generate", body, self.cfg.request_timeout_s)
            except EngineDown as exc:
                if exc.timed_out:  # sending it again would wait as long again, without end
                    raise MilesUserError(f"{url}/generate: no answer within rollout.sglang.request_timeout_s "
                                         f"({self.cfg.request_timeout_s:g} s)") from None
                eng = self._after_failure(eng, url)
                if eng.url == url and not self._abort.is_set():  # the same server, still up, dropped the request
                    drops += 1
                    if drops == 3:
                        log = getattr(eng.server, "log_path", None)
                        raise MilesUserError(f"{url}/generate: the server closed the connection without an answer 3 times "
                                             f"while it stays up{f' (see {log})' if log else ''}")
                continue
            outs = out if isinstance(out, list) else [out]
            if len(outs) != n:
                raise MilesUserError(f"{url}/generate: malformed response, {len(outs)} outputs for n={n}")
            parsed = [parse_output(o, url) for o in outs]
            for out_ids, *_ in parsed:
                bad = next((t for t in out_ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise MilesUserError(f"{url}/generate: token id {bad} is outside the trainer's vocabulary ({self.vocab_size} ids): "
                                         f"the server runs another model than the trainer's (model.hf_checkpoint)")
            return eng.index, attempts, parsed

    def _after_failure(self, eng: Engine, url: str) -> Engine:
        """The engine at ``url`` stopped answering: wait for its restart (launched) or fail (given by URL)."""
        if eng.server is None or self.monitor is None:
            raise MilesUserError(f"{url}: the rollout server stopped answering /generate (rollout.sglang.urls servers are not restarted)")
        deadline = time.monotonic() + self.cfg.startup_timeout_s + 60
        while time.monotonic() < deadline:
            failure = self.monitor.failures.get(eng.index)
            if failure is not None:
                raise MilesUserError(f"{url}: engine {eng.index} died and could not be restarted: {failure}")
            if eng.url != url and eng.up.is_set():
                return eng  # restarted on a new port
            others = [e for e in self.engines if e is not eng and e.up.is_set() and not e.dead()]
            if eng.dead() and others:  # resubmit to a live engine rather than wait for the restart
                return others[eng.index % len(others)]
            if self._abort.is_set():
                return eng
            if not eng.dead() and eng.up.is_set() and healthy(url):
                return eng  # a transient error on a live engine: try again
            time.sleep(0.05)
        raise MilesUserError(f"{url}: engine {eng.index} did not come back within {self.cfg.startup_timeout_s + 60:.0f} s")

    @contextlib.contextmanager
    def _track(self):
        """Count a request in flight (abort_all waits for the count to reach zero)."""
        with self._inflight_lock:
            self._inflight += 1
        try:
            yield
        finally:
            with self._inflight_lock:
                self._inflight -= 1

    def abort_all(self, timeout: float = 30.0) -> None:
        """Abort every request of the running ``generate`` (call it from another thread); returns once
        no request is in flight. ``generate`` then returns the partial samples (``finish_reason="abort"``)."""
        self._abort.set()
        deadline = time.monotonic() + timeout
        while True:
            self._abort_engines(timeout=10)
            with self._inflight_lock:
                if self._inflight == 0:
                    return
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)  # a request that reached its server after the abort: abort again

    def _abort_engines(self, timeout: float) -> None:
        """Ask every engine to abort its requests (they answer with what they have)."""
        for e in self.engines:
            try:
                request(e.url + "/abort_request", {"rid": "", "abort_all": True}, timeout=timeout)
            except (EngineDown, MilesUserError):
                pass  # a dead engine has nothing to abort (its groups return as aborted); one that refuses, neither

    # ------------------------------------------------------------------ bookkeeping
    def pop_metrics(self) -> dict[str, float]:
        """This step's recoveries: ``engine_restarts`` and ``recovery_s`` (their total seconds)."""
        if self.monitor is None:
            return {}
        new = self.monitor.pop_new()
        return {"engine_restarts": float(len(new)), "recovery_s": sum((r.seconds for r in new), 0.0)}

    def summary(self) -> dict[str, Any]:
        if self.monitor is None:
            return {}
        times = [round(r.seconds, 3) for r in self.monitor.recoveries]
        return {"engine_restarts": len(times), "recovery_s": times}

    def shutdown(self) -> None:
        with self._launch_lock:
            self._closing.set()
        for server in self._servers:  # first: a restart waiting for its new server to load then fails at once
            server.stop()
        if self.monitor is not None:
            self.monitor.stop()
            if self.run_extras is not None:
                self.run_extras.setdefault("summary", {}).update(self.summary())
        if self.temporary_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _set_event() -> threading.Event:
    ev = threading.Event()
    ev.set()
    return ev
