"""Saved rollouts (debug modes): one step's samples as ``DIR/step_N.jsonl``, one Sample per line.

Written atomically (a temporary file, fsync, rename), so a reader never sees half a step.
``--load-rollouts DIR`` trains on them with no engine built; rewards are saved with the samples.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from miles_core.errors import DataError
from miles_core.models.checkpoint import atomic_file
from miles_core.rewards.runner import is_reward_value
from miles_core.types import Sample


def step_file(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}.jsonl"


def save_rollouts(root: str | Path, step: int, samples: list[Sample]) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            for s in samples:
                row = dataclasses.asdict(s)
                if row["routed_experts"] is not None:
                    row["routed_experts"] = s.routed_experts.tolist()
                f.write(json.dumps(row) + "\n")

    return atomic_file(step_file(root, step), write)


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def check_row(row: object) -> None:
    """What training reads from a saved row, checked (a TypeError saying what is wrong): rows edited by hand or
    written by another tool otherwise failed as AttributeError / TypeError tracebacks, at load or in training."""
    if not isinstance(row, dict):
        raise TypeError(f"a JSON object, got {type(row).__name__}")
    for key in ("prompt_ids", "response_ids"):
        if not _token_ids(row.get(key)):
            raise TypeError(f"'{key}' must be a list of token ids, got {row.get(key)!r:.40}")
    if not row["prompt_ids"]:
        raise TypeError("'prompt_ids' is empty: the first response token's logprob needs a prompt token before it")
    mask = row.get("loss_mask")
    if mask is not None and not (isinstance(mask, list) and all(type(m) is int and m in (0, 1) for m in mask)):
        raise TypeError(f"'loss_mask' must be a list of 0/1 values or null, got {mask!r:.40}")
    if mask is not None and len(mask) != len(row["response_ids"]):
        raise TypeError(f"'loss_mask' has {len(mask)} values for {len(row['response_ids'])} response tokens")
    if not is_reward_value(row.get("reward")):
        raise TypeError(f"'reward' must be a finite number, got {row.get('reward')!r:.40}")
    logprobs = row.get("rollout_logprobs")
    if not isinstance(logprobs, list):
        raise TypeError(f"'rollout_logprobs' must be a list of numbers, got {logprobs!r:.40}")
    if logprobs and len(logprobs) != len(row["response_ids"]):  # empty: none recorded
        raise TypeError(f"'rollout_logprobs' has {len(logprobs)} values for {len(row['response_ids'])} response tokens")


def load_rollouts(root: str | Path, step: int, vocab_size: int | None = None) -> list[Sample]:
    """``DIR/step_N.jsonl``; with ``vocab_size``, a token id outside it (rollouts of another model) is refused."""
    path = step_file(root, step)
    if not path.is_file():
        raise DataError(f"run.load_rollouts: '{path}' does not exist (save it with --save-rollouts, or lower run.num_rollout)")
    samples = []
    for i, line in enumerate(path.read_text().splitlines()):
        try:
            row = json.loads(line)
            check_row(row)
            if row.get("routed_experts") is not None:
                import torch

                row["routed_experts"] = torch.tensor(row["routed_experts"])
            samples.append(Sample(**row))
        except (json.JSONDecodeError, TypeError) as exc:
            raise DataError(f"{path} line {i + 1}: not a saved sample ({exc})") from None
        if vocab_size is not None:
            s = samples[-1]
            bad = next((t for t in s.prompt_ids + s.response_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise DataError(f"{path} line {i + 1}: token id {bad} is outside the model's vocabulary ({vocab_size} ids): "
                                f"rollouts saved by a run of another model or tokenizer")
    return samples
