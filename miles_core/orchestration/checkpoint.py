"""Resumable run checkpoints: ``run.save`` folder layout, atomic writes, and what a resume restores.

    <save>/latest            the name of the newest complete checkpoint (replaced atomically)
    <save>/step_000010/      one checkpoint, renamed into place only when complete
        trainer/             sharded trainer state (torch.distributed.checkpoint, every rank)
        rng_rank<r>.pt       this rank's RNG states: torch, CUDA, python, the rollout engine's
        critic.pt            the PPO critic (advantage_estimator=ppo): value model, head, optimizer
        loop.json            step, weight version, prompts consumed (the data position) and those of them drawn
                             but not trained yet (pending), the data's fingerprint
        hf/                  the policy as an HF safetensors folder (+ tokenizer): the model to build
    <save>/hf/               the final model (orchestration/run.py)

A save writes into ``.tmp-step_N`` and renames it, then rewrites ``latest``: a save killed at any
point leaves the previous checkpoint and ``latest`` intact. The prompt stream is resumed by
replaying it from the seed and skipping the prompts already consumed, which is exact for every
task whose stream is a function of its ``random.Random`` and its data. The data is the task's
``data_fingerprint`` (a JSONL file's size and sha256): a resume over changed data is refused
(:func:`check_data_fingerprint`) unless ``data.allow_changed_on_resume`` accepts it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from miles_core.data.jsonl import file_fingerprint
from miles_core.errors import ConfigError, DataError
from miles_core.models.checkpoint import fsync_dir, fsync_tree, replace_dir, restore_moved_aside
from miles_core.train.distributed import barrier, current

LATEST = "latest"
log = logging.getLogger(__name__)


@dataclass
class LoopState:
    step: int  # the last RL step completed
    version: int  # weight version pushed to the engines
    prompts_consumed: int  # training prompts taken from the stream so far
    eval_accuracy_first: float | None = None
    data_fingerprint: dict | None = None  # the task's (None: a task without one, or a checkpoint saved before Miles recorded it)
    mode: str = "rl"  # the run.mode that saved it: rl, or sft (whose step and position are examples, not prompts)
    # stream indices (< prompts_consumed) drawn for rollouts not trained yet when it was saved (one_step_off's generation
    # ahead, async's groups in flight or waiting): a resumed run draws them first
    prompts_pending: list[int] = field(default_factory=list)


def save_due(run_cfg, step: int) -> bool:
    """A checkpoint after ``step``: every ``run.save_interval`` steps, and after the last."""
    return bool(run_cfg.save) and ((run_cfg.save_interval and step % run_cfg.save_interval == 0) or step == run_cfg.num_rollout)


def check_mode(ckpt: Path, state: LoopState, mode: str) -> None:
    """A checkpoint's step and stream position are its run.mode's own: an SFT checkpoint resumed by an RL run (or
    the reverse) would skip that many steps of the other. Refused, pointing at its weights to start from."""
    if state.mode != mode:
        raise ConfigError(f"run.load: checkpoint '{ckpt}' was saved by a run.mode={state.mode} run and cannot be resumed "
                          f"by run.mode={mode}; start from its weights instead with run.load={ckpt / 'hf'} (no --resume)")


def find_checkpoint(path: str | Path | None) -> Path | None:
    """The newest checkpoint of a ``run.save`` folder, or None if ``path`` is not one."""
    if path is None:
        return None
    latest = Path(path) / LATEST
    if not latest.is_file():
        return None
    ckpt = Path(path) / latest.read_text().strip()
    if not ckpt.exists():  # a save over it killed between its two renames: the old one goes back
        restore_moved_aside(ckpt, lambda old: (old / "loop.json").is_file())
    if not (ckpt / "loop.json").is_file():
        raise ConfigError(f"run.load: '{latest}' names '{ckpt.name}', which is not a complete checkpoint")
    return ckpt


def remove_killed_saves(save_dir: Path) -> None:
    """Remove what saves killed outright (SIGKILL: the OOM killer, a preemption) left in a ``run.save`` folder: a
    checkpoint's ``.tmp-step_N``, the final model's ``.hf.tmp-*`` (atomic_dir), an old folder moved aside
    (``.step_N.old-PID``, ``.hf.old-PID``) whose replacement is in place. Each can be a whole checkpoint, and nothing
    else removed them (a ``.tmp-step_N`` only when that step was saved again). Called as a run starts, before it
    writes there; a folder moved aside without its replacement stays (find_checkpoint puts it back)."""
    save_dir = Path(save_dir)
    for tmp in [*save_dir.glob(".tmp-step_*"), *save_dir.glob(".hf.tmp-*")]:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in save_dir.glob(".*.old-*"):
        if (save_dir / old.name[1:].rsplit(".old-", 1)[0]).exists():
            shutil.rmtree(old, ignore_errors=True)


def _rng_state(backend) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if hasattr(backend, "get_rng_state"):  # the built-in engine draws each request's sampling seed
        state["engine"] = backend.get_rng_state()
    if hasattr(backend, "get_rng_states"):  # Ray: each engine actor's, which the driver's states do not hold
        state["engines"] = backend.get_rng_states()
    return state


def _set_rng_state(state: dict, backend) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "engine" in state and hasattr(backend, "set_rng_state"):
        backend.set_rng_state(state["engine"])
    if "engines" in state and hasattr(backend, "set_rng_states"):
        backend.set_rng_states(state["engines"])


CRITIC = "critic.pt"


def save_checkpoint(save_dir: Path, state: LoopState, trainer, backend, family, extra_files: dict[str, str],
                    critic=None) -> Path:
    """Called on every rank at the end of an RL step. ``critic``: the PPO value model, trained beside the policy."""
    rank = current()
    name = f"step_{state.step:06d}"
    tmp, final = save_dir / f".tmp-{name}", save_dir / name
    if rank.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    trainer.save(tmp / "trainer")
    torch.save(_rng_state(backend), tmp / f"rng_rank{rank.rank}.pt")
    if hasattr(trainer, "export_hf"):
        trainer.export_hf(family, tmp / "hf", extra_files)
    elif rank.is_main:
        from miles_core.models.checkpoint import save_hf_folder

        save_hf_folder(trainer.model, family, tmp / "hf", extra_files)
    if rank.is_main:
        if critic is not None:
            torch.save(critic.state_dict(), tmp / CRITIC)
        (tmp / "loop.json").write_text(json.dumps(asdict(state)))
        fsync_tree(tmp)
        replace_dir(tmp, final)  # over a step_N of an earlier run in this folder: never a half-removed one
        pointer = save_dir / f".{LATEST}.tmp"
        with open(pointer, "w") as fh:
            fh.write(name)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(pointer, save_dir / LATEST)
        fsync_dir(save_dir)  # the renames (step_N, latest) on disk before the run goes on: a power cut keeps them
    barrier()
    return final


def load_checkpoint(ckpt: Path, trainer, backend, critic=None) -> LoopState:
    """Restore the trainer, the PPO ``critic`` (if the run has one), this rank's RNG states, and return the loop's
    position. A checkpoint without a critic (saved by another algorithm, or before Miles saved it) leaves the critic
    as built, from the checkpoint's policy, with a warning: its values start over."""
    rank = current()
    trainer.load(ckpt / "trainer")
    if critic is not None:
        if (ckpt / CRITIC).is_file():
            critic.load_state_dict(torch.load(ckpt / CRITIC, weights_only=True))
        else:
            log.warning("run.load: checkpoint '%s' has no %s: the PPO critic starts over from the checkpoint's policy "
                        "(values 0)", ckpt, CRITIC)
    rng_file = ckpt / f"rng_rank{rank.rank}.pt"
    if not rng_file.is_file():
        raise ConfigError(f"run.load: '{ckpt}' has no {rng_file.name}; resume with the world size it was saved with")
    _set_rng_state(torch.load(rng_file, weights_only=False), backend)
    return read_loop_state(ckpt)


def read_loop_state(ckpt: Path) -> LoopState:
    """The loop's position saved in ``ckpt`` (no trainer needed: run.mode=rollout reads the weight version)."""
    return LoopState(**json.loads((ckpt / "loop.json").read_text()))


def _describe(fingerprint: dict, path: bool = True) -> str:
    where = f"'{fingerprint.get('path')}', " if path and "path" in fingerprint else ""
    if "size" not in fingerprint and "sha256" not in fingerprint:  # a plugin task's own fields
        return where + json.dumps(_data_key(fingerprint), sort_keys=True)
    return f"{where}{fingerprint.get('size')} bytes, sha256 {str(fingerprint.get('sha256'))[:12]}..."


def _data_key(fingerprint: dict) -> dict:
    """What identifies the data: every field but where it was read from, as loop.json holds it (JSON types)."""
    return json.loads(json.dumps({k: v for k, v in fingerprint.items() if k != "path"}))


def _same_data(saved: dict | None, current: dict | None) -> bool:
    """Only the data counts (a JSONL file's bytes, or whatever else a task's fingerprint records), not its path: the
    same file moved to another path replays the same order."""
    key = lambda fp: None if fp is None else _data_key(fp)  # noqa: E731
    return key(saved) == key(current)


def sft_data_fingerprint(data_cfg, task) -> dict | None:
    """What an SFT run's example stream is made from: ``data.train_path``'s bytes when it reads (prompt, response)
    pairs from it, else the task's data (its reference answers)."""
    if data_cfg.train_path:
        return file_fingerprint(data_cfg.train_path)
    return getattr(task, "data_fingerprint", None)


def check_data_fingerprint(ckpt: Path, saved: dict | None, current: dict | None, allow_changed: bool) -> None:
    """Refuse to resume from ``ckpt`` over other data than it was saved with: the replayed prompt stream would be
    another order of prompts (or other prompts), silently. ``saved`` and ``current`` are task data fingerprints
    (``{"path", "size", "sha256"}``, None for a task without a data file). A checkpoint without one (saved before
    Miles recorded it) resumes unchecked, with a warning."""
    if saved is None:
        if current is not None:
            log.warning("run.load: checkpoint '%s' records no data fingerprint (saved before Miles recorded one, or by a "
                        "run without a data file): cannot check that the data (%s) is the one it was saved with",
                        ckpt, _describe(current))
        return
    if _same_data(saved, current):
        return
    moved = current is not None and saved.get("path") != current.get("path")  # name the saved file only if it was another
    data = ("the task's data" if current is None or "path" not in current else  # (JSONL: the training file)
            f"data.train_path '{current['path']}'" if "sha256" in current else f"the task's data '{current['path']}'")
    what = (f"{data} changed since checkpoint '{ckpt}' was saved (then {_describe(saved, moved)}; "
            f"now {_describe(current, False)})" if current is not None else
            f"checkpoint '{ckpt}' was saved reading the data file {_describe(saved)}, and this run's task reads none")
    if allow_changed:
        log.warning("run.load: %s; data.allow_changed_on_resume=true: replaying the new data's prompt order from the "
                    "saved position", what)
        return
    raise DataError(f"{what}: resuming would replay another prompt order. Restore the file, start fresh without "
                    "--resume, or set data.allow_changed_on_resume=true to continue from the saved position in the new "
                    "data's order")
