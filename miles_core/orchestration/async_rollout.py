"""The ``async`` schedule: rollout runs continuously in a background thread, with partial rollouts.

The thread keeps up to ``2 * rollout.batch_size`` groups in flight or finished-and-waiting, and
steps the built-in engine's core without pause. A finished group is scored and queued;
``get(step)`` takes ``rollout.batch_size`` groups from the queue; once the last step's are taken the thread stops
and aborts what it has running (nobody would train on it).

At a weight update (``before_sync``) the thread aborts every running request at the next step
boundary, keeping what each has generated (tokens and per-token logprobs), and waits. The loop
pushes the new weights (and may evaluate); ``after_sync`` lets the thread resubmit each unfinished
sample as a new request: the prompt plus its partial response as the prompt, the remaining token
budget, and a seed derived from the sample's seed and its length. The sample keeps one list of
response tokens and logprobs across segments; ``metadata["weight_versions"]`` lists the version of
each segment and ``metadata["resumed_at"]`` the response length at each continuation.
``Sample.weight_version`` is the oldest segment's version. A prompt's ``metadata["step"]`` (and its deterministic
seed's step) is the step whose groups ``get`` was collecting when it was drawn; a later step may take it.

Metrics: ``time_generate`` is how long ``get`` waited for its groups (the engine runs meanwhile, not only then), so
the throughput ``rollout_tok_s`` is the engine's own: the tokens it generated since the previous ``get`` over the
seconds it spent in its steps (aborted, dropped and still unfinished samples' tokens included).

Staleness: a group whose oldest version is more than ``orchestration.max_staleness`` behind the
trainer when ``get`` takes it is dropped (``async_dropped_groups``) and new prompts replace it.

Departures: a stop string that spans a continuation boundary is not detected (stop tokens are);
dynamic sampling is not supported with this schedule. Local placement with the built-in engine only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field

from miles_core.errors import ConfigError
from miles_core.orchestration.collect import _score
from miles_core.orchestration.seeds import INDEX_KEY, SEED_KEY, prompt_seed
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import trim_stop
from miles_core.types import Prompt, Sample


@dataclass
class _Partial:
    prompt: Prompt
    seed: int | None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    resumed_at: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    request_id: str | None = None
    stop_ids: frozenset[int] = frozenset()  # the engine's (stop tokens, special-token stop strings, EOS)
    cut: bool = False  # aborted with new tokens: its continuation opens a new segment


class AsyncSchedule:
    def __init__(self, c, backend, next_prompts, params: SamplingParams, last_step: int, first_step: int = 1) -> None:
        cfg = c.ctx.config
        core = getattr(backend, "core", None)
        if core is None:
            raise ConfigError("orchestration.schedule=async drives the built-in engine in process: use rollout.backend=builtin, placement=local")
        self.c, self.backend, self.core, self.next_prompts, self.params = c, backend, core, next_prompts, params
        self.want, self.n = cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt
        self.max_staleness, self.last_step = cfg.orchestration.max_staleness, last_step
        self.version = backend.weight_version
        self.step = first_step  # the step whose groups get collects next: the label of the prompts drawn now
        self.done: queue.Queue[list[_Partial]] = queue.Queue()
        self.groups: list[list[_Partial]] = []  # in flight
        self.by_request: dict[str, tuple[list[_Partial], _Partial]] = {}
        self._pause, self._paused, self._resume, self._stop = (threading.Event() for _ in range(4))
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._groups_lock = threading.Lock()  # a group drawn is in self.groups or self.done (pending_prompts)
        self._engine_s, self._engine_tokens = 0.0, 0  # since the last get: seconds in core.step(), tokens it gave
        self._thread = threading.Thread(target=self._run, name="miles-async-rollout", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the rollout thread
    def _submit(self, group: list[_Partial], part: _Partial) -> None:
        tok = self.c.ctx.tokenizer
        ids = (part.prompt.prompt_ids or tok.encode(part.prompt.text)) + part.response_ids
        seed = None if part.seed is None else prompt_seed(part.seed, len(part.response_ids), 0)
        params = dataclasses.replace(self.params, seed=seed, max_new_tokens=self.params.max_new_tokens - len(part.response_ids))
        (req,) = self.core.add_request(ids, params)
        part.request_id = req.request_id
        self.by_request[req.request_id] = (group, part)

    def _top_up(self) -> None:
        while len(self.groups) + self.done.qsize() < 2 * self.want:
            with self._groups_lock:
                (prompt,) = self.next_prompts(1, self.step)
                seed = prompt.metadata.get(SEED_KEY)
                group = [_Partial(prompt, None if seed is None else seed + i) for i in range(self.n)]
                self.groups.append(group)
            for part in group:
                self._submit(group, part)

    def _collect(self, outputs) -> None:
        for out in outputs:
            if not out.finished or out.request_id not in self.by_request:
                continue
            group, part = self.by_request.pop(out.request_id)
            req = out.request
            part.response_ids += req.output_ids
            part.logprobs += req.logprobs
            if req.output_ids:  # a request aborted before its first token adds no segment
                part.versions.append(req.weight_version)
                part.cut = req.finish_reason == "abort"
            part.finish_reason, part.stop_ids = req.finish_reason, req.stop_ids
            if all(p.finish_reason not in (None, "abort") for p in group):
                with self._groups_lock:
                    self.groups.remove(group)
                    self.done.put(group)

    def _run(self) -> None:
        # every engine step inside the precision recipe's kernel_mode, as BuiltinEngine.generate runs them (a plugin's
        # batch-invariant kernels); entered in this thread, since a TorchFunctionMode holds for its own thread only
        precision = getattr(self.backend, "precision", None)
        mode = precision.kernel_mode(self.backend.device) if precision is not None else contextlib.nullcontext()
        try:
            with mode:
                self._loop()
        except BaseException as exc:  # surfaced by get()
            self._error = exc
            self._paused.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._pause.is_set():
                for rid in list(self.by_request):
                    self.core.abort(rid)
                self._collect(self.core.step())  # the aborted requests, with their partial outputs
                self._paused.set()
                self._resume.wait()
                self._resume.clear()
                for group in self.groups:
                    for part in group:
                        if part.finish_reason == "abort":
                            if part.cut:
                                part.resumed_at.append(len(part.response_ids))
                            part.finish_reason, part.cut = None, False
                            self._submit(group, part)
                continue
            self._top_up()
            if self.core.has_unfinished():
                t0 = time.perf_counter()
                outputs = self.core.step()
                with self._lock:
                    self._engine_s += time.perf_counter() - t0
                    self._engine_tokens += sum(len(out.new_ids) for out in outputs)
                self._collect(outputs)
            else:
                time.sleep(0.001)

    # ------------------------------------------------------------------ the loop's side
    def _sample(self, part: _Partial, gi: int, index: int) -> Sample:
        tok, p = self.c.ctx.tokenizer, part.prompt
        # as BuiltinEngine.generate makes it: without stop tokens, up to the first stop string
        text = tok.decode([t for t in part.response_ids if t not in part.stop_ids])
        text = trim_stop(text, self.params.stop) if self.params.stop else text
        meta = {**p.metadata, "weight_versions": list(part.versions), "resumed_at": list(part.resumed_at)}
        return Sample(p.text, list(p.prompt_ids), list(part.response_ids), text, list(part.logprobs), p.label, gi, index,
                      part.finish_reason, min(part.versions), metadata=meta)

    def get(self, step: int):
        t0 = time.perf_counter()
        kept: list[list[Sample]] = []
        dropped = 0
        while len(kept) < self.want:
            while True:
                if self._error is not None:
                    raise self._error
                try:
                    group = self.done.get(timeout=0.05)
                    break
                except queue.Empty:
                    continue
            samples = [self._sample(p, len(kept), len(kept) * self.n + i) for i, p in enumerate(group)]
            if self.version - min(s.weight_version for s in samples) > self.max_staleness:
                dropped += 1
                continue
            _score(self.c, samples)
            kept.append(samples)
        out = [s for g in kept for s in g]
        resumed = sum(bool(s.metadata["resumed_at"]) for s in out)
        metrics = {"time_generate": time.perf_counter() - t0, "async_dropped_groups": float(dropped), "async_resumed_samples": float(resumed)}
        with self._lock:
            if self._engine_s > 0:
                metrics["rollout_tok_s"] = self._engine_tokens / self._engine_s
            self._engine_s, self._engine_tokens = 0.0, 0
        self.step = step + 1
        if step >= self.last_step:  # nobody trains on more samples: stop generating (and drawing prompts) now
            self._halt()
        return out, metrics

    def before_sync(self) -> None:
        if not self._stop.is_set():  # after the last step's get the thread is gone: the engine is idle already
            self._pause.set()
            self._paused.wait()
        if self._error is not None:
            raise self._error

    def after_sync(self, version: int) -> None:
        self.version = version
        self._pause.clear()
        self._paused.clear()
        self._resume.set()

    def pending_prompts(self) -> list[int]:
        """The stream indices of the groups in flight or waiting (not dropped, not taken by ``get``): the thread draws
        and registers a group under ``_groups_lock``, so none is between the two here."""
        with self._groups_lock:
            return [g[0].prompt.metadata[INDEX_KEY] for g in [*self.groups, *list(self.done.queue)]]

    def close(self) -> None:
        self._halt()

    def _halt(self) -> None:
        """Stop the rollout thread and abort the requests it leaves in the engine (again: a no-op)."""
        self._stop.set()
        self._resume.set()
        self._thread.join(timeout=30)
        for rid in list(self.by_request):
            self.core.abort(rid)
        self.by_request.clear()
        self.core.step()
