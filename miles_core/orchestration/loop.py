"""The RL loop: rollout -> reward -> advantage -> train -> weight sync.

Where the samples come from (synchronous or one-step-off generation, or saved rollouts) is the
schedule's business (:mod:`miles_core.orchestration.schedules`); where the trainer and engines
run is the placement's (:mod:`miles_core.orchestration.placement`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

from miles_core.algorithms.distill import add_distillation
from miles_core.algorithms.masked import masked_mean
from miles_core.algorithms.mismatch import mismatch_metrics
from miles_core.algorithms.stats import advantage_metrics
from miles_core.errors import DataError
from miles_core.orchestration.aux_models import AuxModels, build_aux_models
from miles_core.orchestration.build import Components, tokenizer_files
from miles_core.orchestration.checkpoint import (LoopState, find_checkpoint, load_checkpoint, read_loop_state,
                                                 remove_killed_saves, save_checkpoint, save_due)
from miles_core.orchestration.placement import make_placement
from miles_core.orchestration.rollout_io import save_rollouts
from miles_core.orchestration.schedules import make_source
from miles_core.orchestration.seeds import INDEX_KEY, SEED_KEY, prompt_seed
from miles_core.orchestration.sft_loop import run_sft
from miles_core.rewards.runner import score_samples
from miles_core.rollout.base import SamplingParams
from miles_core.train.batch import lacks_rollout_logprobs, make_train_batch
from miles_core.train.distributed import current
from miles_core.types import AdvantageInputs, Prompt, Sample

log = logging.getLogger(__name__)


class Timer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.times[f"time_{name}"] = timer.times.get(f"time_{name}", 0.0) + time.perf_counter() - self.t0

        return _Span()


def _tokenize(prompts: list[Prompt], tokenizer) -> list[Prompt]:
    """Render and encode each prompt. One that gives no tokens (an empty prompt text beside 'messages' that this
    tokenizer does not render, or an empty last message) is refused here, named by its source (a JSONL row's file
    and line): the reader cannot tell at start-up, and past here it fails in the engine or the trainer."""
    for p in prompts:
        if not p.prompt_ids and "messages" in p.metadata and hasattr(tokenizer, "render_chat"):
            p.text = tokenizer.render_chat(p.metadata["messages"])  # the model's own chat template
        if not p.prompt_ids:
            p.prompt_ids = tokenizer.encode(p.text)
        if not p.prompt_ids:
            why = ("; 'messages' is not rendered: the tokenizer has no chat template, so the prompt text is used"
                   if "messages" in p.metadata and not hasattr(tokenizer, "render_chat") else "")
            raise DataError(f"{p.source or 'a prompt'}: the prompt is empty (it gives no tokens to generate from{why})")
    return prompts


def _reference_samples(prompts: list[Prompt], task, tokenizer) -> list[Sample]:
    samples = []
    for i, p in enumerate(prompts):
        ref = task.reference(p)
        if ref is None:
            continue
        resp = tokenizer.encode(ref) + [tokenizer.eos_token_id]
        samples.append(Sample(p.text, p.prompt_ids, resp, ref, [], p.label, group_id=i, index=i))
    return samples


def evaluate(c: Components, backend, prompts: list[Prompt]) -> dict[str, float]:
    """Greedy decoding on the held-out prompts: task accuracy and mean reward."""
    cfg = c.ctx.config
    params = SamplingParams(max_new_tokens=cfg.rollout.max_response_len, temperature=0.0, stop=cfg.rollout.stop)
    samples = backend.generate(prompts, params, n=1)
    correct = [c.task.score(s.response, s.label) >= 1.0 for s in samples]
    rewards = score_samples(c.reward_fn, c.reward_name, samples, cfg.reward.timeout_s)
    return {"eval_accuracy": sum(correct) / len(correct), "eval_reward": sum(rewards) / len(rewards)}


def check_rollout_logprobs(c: Components, samples: list[Sample], step: int) -> None:
    """A mismatch correction weighs each token by exp(old - rollout logprob): refuse the step, before any training,
    when some samples have no rollout logprobs (the batch then has none, see make_train_batch)."""
    cfg = c.ctx.config
    missing = sum(lacks_rollout_logprobs(s) for s in samples)
    if missing and cfg.algorithm.mismatch_correction != "none":
        source = (f"saved rollouts in {cfg.run.load_rollouts} without 'rollout_logprobs'" if cfg.run.load_rollouts
                  else "the rollout backend returned none")
        raise DataError(f"algorithm.mismatch_correction={cfg.algorithm.mismatch_correction} needs the rollout engine's "
                        f"per-token logprobs; {missing} of {len(samples)} samples of step {step} have none ({source}); "
                        f"set algorithm.mismatch_correction=none to train without it")


_LAST_OVER_UPDATES = frozenset({"lr"})  # a state the updates leave behind, not a measurement of each


def mean_over_updates(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's metrics from its optimizer updates (``train.updates_per_rollout``): each number's mean, so that every
    update counts, not only the last; the learning rate (and anything not a number) as the last update left it."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for u in updates for k in u):
        values = [u[key] for u in updates if key in u]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        merged[key] = sum(values) / len(values) if numbers and key not in _LAST_OVER_UPDATES else values[-1]
    return merged


def rl_step(c: Components, trainer, aux: AuxModels, samples: list[Sample], metrics: dict[str, Any], step: int, timer: Timer) -> dict[str, Any]:
    """Train on one step's scored samples (from the rollout schedule or saved rollouts)."""
    cfg = c.ctx.config
    tok = c.ctx.tokenizer
    algo = cfg.algorithm
    rewards = [s.reward for s in samples]
    if not samples:  # dynamic sampling found no informative group: nothing to train on
        return {**metrics, "reward_mean": float("nan"), "skipped": 1.0}
    check_rollout_logprobs(c, samples, step)
    batch = make_train_batch(samples, tok.pad_token_id)
    reuse = (cfg.train.old_logprobs == "auto" and cfg.train.updates_per_rollout == 1 and not algo.needs_reference
             and aux.teacher is None and aux.critic is None and not c.estimator_needs_old_logprobs
             and getattr(trainer, "on_policy_old_logprobs", False))
    with timer("logprobs"):
        batch.old_logprobs = None if reuse else trainer.compute_logprobs(batch)
        if cfg.algorithm.needs_reference:
            batch.ref_logprobs = trainer.compute_ref_logprobs(batch)
        if aux.teacher is not None:
            batch.teacher_logprobs = aux.teacher.compute_logprobs(batch)
        if aux.critic is not None:
            batch.values = aux.critic.compute_values(batch)
    with timer("advantage"):
        inputs = AdvantageInputs(
            rewards=torch.tensor(rewards),
            group_ids=torch.tensor([s.group_id for s in samples]),
            response_mask=batch.response_mask,
            old_logprobs=batch.old_logprobs,
            ref_logprobs=batch.ref_logprobs,
            values=batch.values,
            teacher_logprobs=batch.teacher_logprobs,
        )
        adv = add_distillation(c.advantage_estimator(inputs, algo), inputs, algo)
        batch.advantages, batch.returns = adv.advantages, adv.returns
    with timer("train"):
        order = torch.randperm(batch.num_samples)
        updates = []
        # tensor_split, not chunk: chunk's parts of ceil(N / k) samples make fewer than k parts (8 samples, k=5: four),
        # fewer optimizer steps than the LR schedule counts; a batch of fewer than k samples (dynamic sampling) has
        # no empty parts to step on
        for part in (p for p in order.tensor_split(cfg.train.updates_per_rollout) if len(p)):
            update = trainer.train_step(batch.select(part), c.policy_loss)
            if aux.critic is not None:
                update = {**update, **aux.critic.train_step(batch.select(part))}
            updates.append(update)
        metrics.update(mean_over_updates(updates))
    mask = batch.response_mask
    n_tokens = float(mask.sum())
    metrics.update(advantage_metrics(batch.advantages, mask))
    # without old logprobs the trainer reported the mismatch (miles_core.train.on_policy); without rollout ones there is none
    if batch.old_logprobs is not None and batch.rollout_logprobs is not None:
        metrics.update(mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, mask))
        metrics["mismatch_abs"] = float(((batch.rollout_logprobs - batch.old_logprobs).abs() * mask).sum() / max(n_tokens, 1))
    if batch.teacher_logprobs is not None:
        metrics["distill_reverse_kl"] = float(masked_mean(batch.old_logprobs - batch.teacher_logprobs, mask))
    metrics.update(
        reward_mean=sum(rewards) / len(rewards),
        train_accuracy=sum(c.task.score(s.response, s.label) >= 1.0 for s in samples) / len(samples),
        response_len=sum(len(s.response_ids) for s in samples) / len(samples),  # with loss masks, more than trained
    )
    return metrics


def rollout_metrics(c: Components, samples: list[Sample], metrics: dict[str, Any]) -> dict[str, Any]:
    """run.mode=rollout: what the samples say, without training."""
    if not samples:
        return {**metrics, "reward_mean": float("nan")}
    return {
        **metrics,
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "train_accuracy": sum(c.task.score(s.response, s.label) >= 1.0 for s in samples) / len(samples),
        "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
    }


def serve_checkpoint(c: Components, backend, ckpt: Path) -> int:
    """run.mode=rollout from a checkpoint: the engine was built from its weights (build's ``model_source``) but
    holds them as version 0. Push them under the checkpoint's version, so that the samples and records name the
    weights that made them (and engines given by URL get those weights too); return that version."""
    version = read_loop_state(ckpt).version
    c.transport.push(c.model.state_dict(), version, backend)
    c.ctx.plugins.after_weight_sync(c.ctx, version)
    return version


def run_loop(c: Components, on_metrics) -> tuple[dict[str, Any], Any]:
    """Run warm-up and RL steps; ``on_metrics(record)`` receives each step's metrics dict.

    Returns the summary and the trainer (which holds the final weights)."""
    ctx, cfg = c.ctx, c.ctx.config
    tok = ctx.tokenizer
    # the task's prompts before the placement starts engines: a task (or chat template) that raises leaves none open
    stream = c.task.train_prompts(random.Random(cfg.run.seed))
    eval_prompts = _tokenize(c.task.eval_prompts(), tok)
    placement = make_placement(c)
    trainer, backend = placement.trainer, placement.backend
    version = 0
    summary: dict[str, Any] = {"status": "failed"}
    history: list[dict[str, Any]] = []
    ckpt = find_checkpoint(cfg.run.load)
    if cfg.run.save and current().is_main:
        remove_killed_saves(Path(cfg.run.save))
    resume = ckpt if trainer is not None else None
    consumed, start, first_eval = 0, 1, None
    replay: list[tuple[int, Prompt]] = []  # (stream index, prompt) the checkpoint's run drew but did not train: drawn first
    source = None
    failure: BaseException | None = None
    try:
        ctx.plugins.run_start(ctx)  # in the try: a plugin failing here still gets run_end, and the engines are closed
        if cfg.run.mode == "sft":
            refs = _reference_samples(eval_prompts, c.task, tok)
            summary = run_sft(c, backend, trainer, eval_prompts, refs, evaluate, on_metrics, resume)
            return summary, trainer
        t = cfg.train
        aux = AuxModels()
        if resume is not None:  # continue a --save folder: skip warm-up, replay the prompt stream
            # built before the RNG states are restored, as the saved run built it before its step 1 (the critic's
            # head draws an initialisation); its weights and optimizer then come from the checkpoint
            aux = build_aux_models(c, trainer)
            state = load_checkpoint(resume, trainer, backend, aux.critic)
            consumed, start, version, first_eval = state.prompts_consumed, state.step + 1, state.version, state.eval_accuracy_first
            pending = set(state.prompts_pending)
            for i in range(consumed):
                p = next(stream)
                if i in pending:
                    replay.append((i, p))
            if backend is not None:
                c.transport.push(trainer.weights(), version, backend)
                ctx.plugins.after_weight_sync(ctx, version)
        elif ckpt is not None and trainer is None and backend is not None:
            version = serve_checkpoint(c, backend, ckpt)
        elif trainer is None and backend is not None:  # run.mode=rollout on the engines' own weights (URL servers: theirs)
            version = backend.weight_version
        for w in range(t.sft_warmup_steps if resume is None and trainer is not None else 0):
            timer = Timer()
            prompts = _tokenize(list(itertools.islice(stream, t.sft_batch_size)), tok)
            consumed += len(prompts)
            refs = _reference_samples(prompts, c.task, tok)
            if not refs:  # nothing to train on (JSONL rows without a label)
                raise DataError(f"train.sft_warmup_steps trains on the task's reference answers: task '{c.task.name}' has none "
                                f"for the {len(prompts)} prompts of warm-up step {w + 1} (JSONL: data.label_key)")
            batch = make_train_batch(refs, tok.pad_token_id)
            with timer("train"):
                m = trainer.train_step(batch, c.sft_loss, temperature=1.0, lr=t.sft_lr or t.lr)
            on_metrics({"phase": "sft", "step": w + 1, **m, **timer.times})
        if t.sft_warmup_steps and resume is None and trainer is not None:
            version += 1
            if backend is not None:
                c.transport.push(trainer.weights(), version, backend)
            ctx.plugins.after_weight_sync(ctx, version)
        elif resume is None and trainer is not None and backend is not None and (
                backend.weight_version != version or getattr(backend, "foreign_weights", False)):
            # engines given by URL may hold another run's weights (whatever version they report): give them the trainer's
            c.transport.push(trainer.weights(), version, backend)
            ctx.plugins.after_weight_sync(ctx, version)
        if resume is None and trainer is not None:
            trainer.reset_reference()  # the KL reference is the policy as RL starts (after warm-up)
            aux = build_aux_models(c, trainer)

        def next_prompts(n: int, step: int) -> list[Prompt]:
            nonlocal consumed
            # A task may serve one Prompt object again (a file, epoch after epoch; twice in a batch where an epoch
            # ends): each use gets its own metadata, so that its step and sampling seed are not another use's.
            drawn = [replay.pop(0) for _ in range(min(n, len(replay)))]
            drawn += [(consumed + i, p) for i, p in enumerate(itertools.islice(stream, n - len(drawn)))]
            prompts = _tokenize([dataclasses.replace(p, metadata=dict(p.metadata)) for _, p in drawn], tok)
            for (index, _), p in zip(drawn, prompts):
                p.metadata.setdefault("step", step)
                p.metadata[INDEX_KEY] = index  # the schedules report the untrained ones by it (pending_prompts)
                if cfg.orchestration.deterministic:
                    p.metadata[SEED_KEY] = prompt_seed(cfg.run.seed, step, index)
            consumed = max([consumed, *(index + 1 for index, _ in drawn)])
            return prompts

        r = cfg.rollout
        params = SamplingParams(r.max_response_len, r.temperature, r.top_p, r.top_k, stop=r.stop)
        if resume is None and backend is not None:
            record = {"phase": "rl", "step": 0, "weight_version": version, **evaluate(c, backend, eval_prompts)}
            history.append(record)
            on_metrics(record)
            first_eval = record["eval_accuracy"]
        if start <= cfg.run.num_rollout:  # else (a resumed finished run) none: async's thread would step the engine in the eval
            source = make_source(c, backend, next_prompts, params, cfg.run.num_rollout, start)  # async: generation starts here
        for step in range(start, cfg.run.num_rollout + 1):
            timer = Timer()
            t0 = time.perf_counter()
            with timer("rollout"):
                samples, metrics = source.get(step)
            if cfg.run.save_rollouts or cfg.run.mode == "rollout":
                save_rollouts(cfg.run.save_rollouts or ctx.output_dir / "rollouts", step, samples)
            ctx.plugins.after_rollout(ctx, step, samples)
            if trainer is None:  # run.mode=rollout
                metrics = rollout_metrics(c, samples, metrics)
            else:
                with placement.training():
                    metrics = rl_step(c, trainer, aux, samples, metrics, step, timer)
                ctx.plugins.after_train_step(ctx, step, metrics)
            # no samples (dynamic sampling kept no group): rl_step took no optimizer step, so there are no new weights
            # to push and no new version; the engine goes on with the ones it holds
            trained = trainer is not None and bool(samples)
            eval_due = backend is not None and (step % cfg.run.eval_every == 0 or step == cfg.run.num_rollout)
            # the engine is idle from before_sync to after_sync (async: its running requests are cut, to be continued),
            # so only for a weight push or an eval: run.mode=rollout's steps go on generating between them
            pause = trained or eval_due
            with timer("sync"):
                if pause:
                    source.before_sync()
                if trained:
                    version += 1
                    if backend is not None:
                        c.transport.push(trainer.weights(), version, backend)
            if trained:
                ctx.plugins.after_weight_sync(ctx, version)
            if eval_due:
                with timer("eval"):
                    metrics.update(evaluate(c, backend, eval_prompts))
            if pause:
                source.after_sync(version)
            record = {"phase": "rl", "step": step, "weight_version": version, **metrics, **timer.times}
            record["time_step"] = time.perf_counter() - t0
            history.append(record)
            on_metrics(record)
            if trainer is not None and save_due(cfg.run, step):
                # the position first, then what is pending: a prompt the async thread draws in between is past it
                position, waiting = consumed, [i for i, _ in list(replay)]
                pending = sorted({*waiting, *(i for i in source.pending_prompts() if i < position)})
                state = LoopState(step, version, position, first_eval, getattr(c.task, "data_fingerprint", None),
                                  prompts_pending=pending)
                save_checkpoint(Path(cfg.run.save), state, trainer, backend, c.family, tokenizer_files(tok), aux.critic)
        evals = [h for h in history if "eval_accuracy" in h]
        if not evals and resume is not None and backend is not None:
            # the checkpoint was already at run.num_rollout: nothing trained, but its weights are the run's result
            log.warning("the checkpoint in %s is at step %d, run.num_rollout=%d: nothing to train", cfg.run.load, start - 1,
                        cfg.run.num_rollout)
            evals = [evaluate(c, backend, eval_prompts)]
        summary = {
            "status": "completed",
            "steps": cfg.run.num_rollout,
            "weight_version": version,
            "eval_accuracy_first": first_eval,
            "eval_accuracy_last": evals[-1]["eval_accuracy"] if evals else first_eval,
            "eval_accuracy_gain": None if first_eval is None else (evals[-1]["eval_accuracy"] if evals else first_eval) - first_eval,
        }
        return summary, trainer
    except BaseException as exc:
        failure = exc
        if isinstance(exc, KeyboardInterrupt):
            summary = {"status": "interrupted"}
        raise
    finally:
        try:
            if source is not None:
                after_failure(source.close, failure, "closing the rollout source")
            after_failure(lambda: ctx.plugins.run_end(ctx, summary), failure, "run_end")
        finally:
            placement.close()


def after_failure(fn, failure: BaseException | None, what: str) -> None:
    """``fn()``, a cleanup in the loop's ``finally`` (the schedule's close: one_step_off aborts the generation running
    ahead through the backend, whose engine may be what failed; miles_run_end, a plugin's). While the run is failing
    (``failure``), an error here is logged, not raised: raised from ``finally`` it would replace the run's own, and the
    CLI's one line would name the cleanup instead."""
    try:
        fn()
    except Exception as exc:
        if failure is None:
            raise
        log.error("%s raised %s: %s; the run had already failed: see the error below", what, type(exc).__name__, exc)
