"""Start-up checks of a run's config against its data, tokenizer, devices and algorithm.

Each refuses with one ConfigError or DataError naming the key or file what would otherwise fail later: at the first
step, at the first save, or not at all (a silently wrong run). ``build`` (and so ``miles validate``) calls them
before any engine or trainer is made.
"""

from __future__ import annotations

from pathlib import Path

import torch

from miles_core.config.schema import MilesConfig
from miles_core.data.base import Task
from miles_core.data.jsonl import JsonlTask
from miles_core.data.synthetic import ReverseTask
from miles_core.data.tokenizer import CharTokenizer
from miles_core.errors import ConfigError, DataError
from miles_core.orchestration.checkpoint import check_data_fingerprint, check_mode, find_checkpoint, read_loop_state, sft_data_fingerprint
from miles_core.orchestration.plugin_calls import component_name, plugin_call
from miles_core.types import Sample


def check_run_folders(cfg: MilesConfig) -> None:
    """The folders a run writes must be folders, or be creatable: one that is a file (or under one) failed only when
    first written, for run.save after the whole run's training, with NotADirectoryError. The folder of saved
    rollouts to train on must be there."""
    for key in ("run.save", "run.save_rollouts", "run.output_dir"):
        path = getattr(cfg.run, key.split(".")[1])
        if not path:
            continue
        existing = Path(path)
        while not existing.exists() and existing != existing.parent:  # the nearest part of the path that is there
            existing = existing.parent
        if existing.exists() and not existing.is_dir():
            raise ConfigError(f"{key} '{path}': '{existing}' is a file, not a folder")
    if cfg.run.load_rollouts and not Path(cfg.run.load_rollouts).is_dir():  # else found at step 1, after the warm-up
        raise DataError(f"run.load_rollouts: '{cfg.run.load_rollouts}' does not exist (save rollouts there with --save-rollouts)")


def check_resume_data(cfg: MilesConfig, task: Task) -> None:
    """A resumed RL run replays the prompt stream from its checkpoint's position, which is exact only over the data
    the checkpoint was saved with: checked here, before any engine or trainer is built (``miles validate`` too).
    run.mode=rollout takes only the checkpoint's weights; sft continues its own stream of examples (data.train_path's
    pairs, or the task's reference answers), checked the same way; run.load_rollouts trains on saved samples,
    drawing no prompts."""
    ckpt = find_checkpoint(cfg.run.load)
    if ckpt is None or cfg.run.mode == "rollout":
        return
    state = read_loop_state(ckpt)
    if cfg.run.mode == "sft":  # its own checkpoints continue its example stream; an RL one gives it only weights
        if state.mode == "sft":
            check_data_fingerprint(ckpt, state.data_fingerprint, sft_data_fingerprint(cfg.data, task), cfg.data.allow_changed_on_resume)
        return
    check_mode(ckpt, state, "rl")
    if cfg.run.load_rollouts:
        return
    check_data_fingerprint(ckpt, state.data_fingerprint, getattr(task, "data_fingerprint", None), cfg.data.allow_changed_on_resume)


def check_char_alphabet(made: Task, task: Task, tokenizer: CharTokenizer, sft_examples: list[Sample] | None = None) -> None:
    """The tiny models' character tokenizer encodes a character outside its alphabet as <unk> and decodes none back: a
    prompt with one is trained on as <unk>, and a reference answer with one no response can spell (reward 0 throughout,
    no error). Checked at start-up: the reverse task's alphabet, the JSONL task's training prompts, and every task's
    held-out prompts with their answers (labels that are text), and run.mode=sft's (prompt, response) examples."""
    checks: list[tuple[str, str, str]] = []  # (where, what, text)
    if isinstance(made, ReverseTask):
        checks.append((f"data.task_options.alphabet {made.alphabet!r}", "", made.alphabet))
    prompts = [*(made.train if isinstance(made, JsonlTask) else []), *task.eval_prompts()]
    for i, p in enumerate(prompts):
        where = p.source or f"held-out prompt {i} of task '{made.name}'"
        checks.append((where, f": the prompt {p.text!r}", p.text))
        if isinstance(p.label, str):  # the answer; not task.reference(p), which may draw (a flawed teacher's demo_noise)
            checks.append((where, f": the answer {p.label!r}", p.label))
    for s in sft_examples or []:
        checks.append((s.metadata["source"], f": the prompt {s.prompt!r}", s.prompt))
        checks.append((s.metadata["source"], f": the response {s.response!r}", s.response))
    known = set(tokenizer.alphabet)
    for where, what, text in checks:
        unknown = sorted(set(text) - known)
        if unknown:
            error = ConfigError if not what else DataError
            raise error(f"{where}{what} has characters the built-in character tokenizer does not: "
                        f"{', '.join(map(repr, unknown))} (its alphabet: {tokenizer.alphabet!r}); they would be read as "
                        "<unk> and no response could spell them: use those characters only, or an HF model "
                        "(model.hf_checkpoint) whose tokenizer has them")


def check_tokenizer_tokens(cfg: MilesConfig, tokenizer, source: str) -> None:
    """The special tokens a run writes into its samples: an SFT response ends with the eos, and training batches are
    padded with the pad token (or the eos). An HF tokenizer may name neither (and no config file an eos id): None in
    the token ids failed later in make_train_batch, with no word of the tokenizer."""
    sft = "run.mode=sft" if cfg.run.mode == "sft" else "train.sft_warmup_steps" if cfg.train.sft_warmup_steps else None
    if tokenizer.eos_token_id is None and sft:
        raise ConfigError(f"the tokenizer of '{source}' has no eos token (its tokenizer_config.json names no eos_token, "
                          f"config.json and generation_config.json no eos_token_id): {sft} ends every response with it; "
                          "set eos_token in tokenizer_config.json")
    if tokenizer.pad_token_id is None and cfg.run.mode != "rollout":
        raise ConfigError(f"the tokenizer of '{source}' has neither a pad nor an eos token: training batches are padded "
                          "with one; set pad_token or eos_token in its tokenizer_config.json")


def check_sft_schedule(cfg: MilesConfig) -> None:
    """run.mode=sft's cosine decays from train.sft_lr (or train.lr) to train.min_lr: a floor above the peak would
    make the rate rise."""
    peak = cfg.train.sft_lr or cfg.train.lr
    if cfg.run.mode == "sft" and cfg.train.lr_decay == "cosine" and cfg.train.min_lr > peak:
        raise ConfigError(f"train.min_lr ({cfg.train.min_lr}) must not exceed train.sft_lr ({peak}): run.mode=sft's cosine "
                          "decays from train.sft_lr to train.min_lr")


def check_precision(name: str, recipes, device: torch.device) -> None:
    """``train.precision=name`` must be able to run on ``device``: refused here, not by its kernels at the first step."""
    recipe = recipes.get(name, key="train.precision")
    why = plugin_call(f"unavailable of {component_name(recipes, name)}", recipe.unavailable, device)
    if why:
        raise ConfigError(f"train.precision={name} cannot run on {device}: {why}")


def check_algorithm(cfg: MilesConfig, estimator=None) -> None:
    """Checks of the algorithm section that need other sections (and the estimator's ``needs_groups``)."""
    a, r = cfg.algorithm, cfg.rollout
    groups = cfg.run.mode != "sft" and getattr(estimator, "needs_groups", False)  # its baseline is the prompt's group
    if cfg.run.mode != "sft" and r.n_samples_per_prompt < 2:
        # a group of one sample has no baseline: every advantage would be 0 and nothing would be learned
        if groups:
            raise ConfigError(
                f"algorithm.advantage_estimator={a.advantage_estimator} compares the samples of a prompt with each other: "
                f"it needs rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt}"
            )
        if a.dynamic_sampling:
            raise ConfigError("algorithm.dynamic_sampling drops groups whose rewards are all equal, which a group of one "
                              f"always is: it needs rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt}")
    if groups and r.temperature == 0 and r.backend in ("builtin", "sglang"):
        # greedy samples of one prompt are one sample n times (a plugin's backend, an agent's say, may still vary them)
        raise ConfigError(
            f"algorithm.advantage_estimator={a.advantage_estimator} compares the samples of a prompt with each other, and "
            f"rollout.temperature=0 makes them identical (every advantage 0): sample with rollout.temperature > 0"
        )
    if a.dynamic_sampling and cfg.orchestration.schedule == "async":  # here, not when the loop makes the schedule (after the warm-up)
        raise ConfigError("orchestration.schedule=async does not support algorithm.dynamic_sampling yet")
    if a.overlong_buffer >= r.max_response_len:
        raise ConfigError(
            f"algorithm.overlong_buffer ({a.overlong_buffer}) must be below rollout.max_response_len ({r.max_response_len})"
        )
