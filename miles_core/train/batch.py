"""Samples -> a padded :class:`TrainBatch`."""

from __future__ import annotations

import torch

from miles_core.errors import DataError
from miles_core.types import Sample, TrainBatch


def lacks_rollout_logprobs(sample: Sample) -> bool:
    """A response without the engine's per-token logprobs (``[]``: saved rollouts without them, a backend that
    gives none)."""
    return bool(sample.response_ids) and not sample.rollout_logprobs


def check_alignment(s: Sample) -> None:
    """Refuse a sample whose response the trainer cannot line up: token t's logprob comes from the position before
    it, so a response needs a prompt token (else the first one read the hidden state of the sample packed before it),
    and a loss mask or the engine's logprobs (when given) has one value per response token."""
    r = len(s.response_ids)
    where = f"sample {s.index} (prompt {s.prompt!r:.40})"
    if r and not s.prompt_ids:
        raise DataError(f"{where} has no prompt token: its first response token is predicted from the position before it")
    if s.loss_mask is not None and len(s.loss_mask) != r:
        raise DataError(f"{where}: loss_mask has {len(s.loss_mask)} values for {r} response tokens")
    if s.rollout_logprobs and len(s.rollout_logprobs) != r:
        raise DataError(f"{where}: rollout_logprobs has {len(s.rollout_logprobs)} values for {r} response tokens")


def make_train_batch(samples: list[Sample], pad_id: int, advantages: torch.Tensor | None = None) -> TrainBatch:
    """``rollout_logprobs`` is None unless every sample has them: zeros for the missing ones would read as
    probability 1 to the mismatch correction and metrics."""
    n = len(samples)
    total = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    t_max = max(max(len(s.response_ids) for s in samples), 1)
    input_ids = torch.full((n, total), pad_id, dtype=torch.long)
    mask = torch.zeros((n, t_max))
    rollout_lp = torch.zeros((n, t_max))
    for i, s in enumerate(samples):
        check_alignment(s)
        seq = s.prompt_ids + s.response_ids
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        r = len(s.response_ids)
        lm = s.loss_mask if s.loss_mask is not None else [1] * r
        mask[i, :r] = torch.tensor(lm, dtype=torch.float32)
        if s.rollout_logprobs:
            rollout_lp[i, :r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_lens=torch.tensor([len(s.response_ids) for s in samples]),
        response_mask=mask,
        advantages=advantages if advantages is not None else torch.zeros((n, t_max)),
        old_logprobs=torch.zeros((n, t_max)),
        rollout_logprobs=None if any(lacks_rollout_logprobs(s) for s in samples) else rollout_lp,
    )
