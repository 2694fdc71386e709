"""``run.mode=sft``: supervised training only, no rollouts for training.

Examples come from ``data.train_path`` (JSONL (prompt, response) pairs with optional loss masks,
miles_core/data/sft.py) or, without a file, from the task's reference answers. Each of the
``run.num_rollout`` steps is one optimizer step on ``train.sft_batch_size`` examples (epochs are
reshuffled with the run seed) at the scheduled LR (``train.lr_warmup_steps``, ``train.lr_decay``, ...
over ``run.num_rollout`` steps) peaking at ``train.sft_lr`` (or ``train.lr``). Every ``run.eval_every``
steps, and before the first and after the last, the weights go to the engine and the held-out
prompts are decoded greedily (``eval_accuracy``); ``eval_nll`` is the mean per-token NLL of the
held-out reference answers (absent where the held-out prompts have none).

With ``run.save``, a checkpoint every ``run.save_interval`` steps and after the last (as RL's, with
``mode: sft``); ``--resume`` continues from it: weights, optimizer, RNG states, step and the position
in the example stream. A checkpoint of an RL run gives an SFT run only its weights (it starts at step 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Iterator
from typing import Any

from pathlib import Path

from miles_core.algorithms.masked import masked_mean
from miles_core.errors import DataError
from miles_core.orchestration.build import tokenizer_files
from miles_core.orchestration.checkpoint import (LoopState, load_checkpoint, read_loop_state, save_checkpoint, save_due,
                                                 sft_data_fingerprint)
from miles_core.train.batch import make_train_batch
from miles_core.train.lr import lr_at
from miles_core.types import Sample

NO_REFERENCE_LIMIT = 1000  # training prompts in a row without a reference answer before run.mode=sft gives up


def _examples(c, rng: random.Random) -> Iterator[Sample]:
    tok = c.ctx.tokenizer
    if c.sft_examples is not None:  # data.train_path's, read by build
        pool = c.sft_examples
        while True:
            order = list(range(len(pool)))
            rng.shuffle(order)
            yield from (pool[i] for i in order)
    from miles_core.orchestration.loop import _reference_samples, _tokenize

    missed = 0  # prompts in a row without a reference answer: a task with none would be drawn from forever
    for p in c.task.train_prompts(rng):
        refs = _reference_samples(_tokenize([p], tok), c.task, tok)
        missed = 0 if refs else missed + 1
        if missed == NO_REFERENCE_LIMIT:
            raise DataError(f"run.mode=sft without data.train_path trains on the task's reference answers: task "
                            f"'{c.task.name}' gave none for {missed} training prompts in a row; give (prompt, response) "
                            "examples in data.train_path")
        yield from refs


def eval_nll(c, trainer, eval_refs: list[Sample]) -> float:
    batch = make_train_batch(eval_refs, c.ctx.tokenizer.pad_token_id)
    return float(-masked_mean(trainer.compute_logprobs(batch, temperature=1.0), batch.response_mask))


def run_sft(c, backend, trainer, eval_prompts, eval_refs, evaluate, on_metrics, resume: Path | None = None) -> dict[str, Any]:
    cfg, t = c.ctx.config, c.ctx.config.train
    schedule = dataclasses.replace(t, lr=t.sft_lr or t.lr)  # the run's steps are SFT steps: they follow the schedule
    stream = _examples(c, random.Random(cfg.run.seed))
    version, start, consumed, first_eval = 0, 1, 0, None
    history = []
    if resume is not None and read_loop_state(resume).mode == "sft":  # continue: skip the examples already trained on
        state = load_checkpoint(resume, trainer, backend)
        version, start, consumed, first_eval = state.version, state.step + 1, state.prompts_consumed, state.eval_accuracy_first
        for _ in range(consumed):
            next(stream)

    def do_eval(step: int, record: dict[str, Any]) -> None:
        nonlocal version
        version += 1
        c.transport.push(trainer.weights(), version, backend)
        c.ctx.plugins.after_weight_sync(c.ctx, version)
        record.update(evaluate(c, backend, eval_prompts))
        if eval_refs:  # held-out prompts without reference answers (JSONL rows without a label) have no NLL
            record["eval_nll"] = eval_nll(c, trainer, eval_refs)

    if start == 1:
        first: dict[str, Any] = {"phase": "sft", "step": 0}
        do_eval(0, first)
        history.append(first)
        on_metrics(first)
        first_eval = first["eval_accuracy"]
    for step in range(start, cfg.run.num_rollout + 1):
        t0 = time.perf_counter()
        examples = list(itertools.islice(stream, t.sft_batch_size))
        consumed += len(examples)
        batch = make_train_batch(examples, c.ctx.tokenizer.pad_token_id)
        lr = lr_at(step - 1, schedule, cfg.run.num_rollout)
        record: dict[str, Any] = {"phase": "sft", "step": step, **trainer.train_step(batch, c.sft_loss, temperature=1.0, lr=lr)}
        c.ctx.plugins.after_train_step(c.ctx, step, record)
        if step % cfg.run.eval_every == 0 or step == cfg.run.num_rollout:
            do_eval(step, record)
        record["time_step"] = time.perf_counter() - t0
        history.append(record)
        on_metrics(record)
        if save_due(cfg.run, step):
            state = LoopState(step, version, consumed, first_eval, sft_data_fingerprint(cfg.data, c.task), mode="sft")
            save_checkpoint(Path(cfg.run.save), state, trainer, backend, c.family, tokenizer_files(c.ctx.tokenizer))
    evals = [h for h in history if "eval_accuracy" in h]
    trains = [h["nll"] for h in history if "nll" in h]
    last = evals[-1]["eval_accuracy"] if evals else first_eval  # a resume of a finished run evaluates nothing
    return {
        "status": "completed",
        "mode": "sft",
        "steps": cfg.run.num_rollout,
        "weight_version": version,
        "eval_accuracy_first": first_eval,
        "eval_accuracy_last": last,
        "eval_accuracy_gain": last - first_eval,
        "eval_nll_first": evals[0].get("eval_nll") if start == 1 else None,  # a resumed run's first NLLs were its first part's
        "eval_nll_last": evals[-1].get("eval_nll") if evals else None,
        "train_nll_first": trains[0] if trains and start == 1 else None,
        "train_nll_last": trains[-1] if trains else None,
    }
