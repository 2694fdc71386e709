"""The trainer interface the RL loop drives."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from miles_core.types import LossInputs, LossOutput, TrainBatch

LossFn = Callable[[LossInputs], LossOutput]


def no_response_tokens(hidden: torch.Tensor, head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) for a micro-batch without one response token (every response empty): two
    empty tensors still tied to the decoder's output and the LM head, so that its loss's backward
    runs (under FSDP / tensor parallelism joining the other ranks' collectives) with zero gradients."""
    empty = ((hidden.sum() + head_weight.sum()) * 0.0).float().reshape(1)[:0]
    return empty, empty


def keeps_reference(cfg) -> bool:
    """Whether a trainer keeps a frozen KL reference: a KL term uses one (algorithm.kl_coef > 0), in a run that trains
    with RL. run.mode=sft computes no KL: its copy of the policy would only take memory (and checkpoint space)."""
    return cfg.algorithm.needs_reference and cfg.run.mode != "sft"


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: float) -> float:
    """``optimizer.step()`` unless the gradient norm is NaN or infinite (an overflow, a loss that blew up on one batch):
    such a step would write NaN into the weights and Adam's moments for good, so it is skipped and the weights stay
    as they were. Returns 1.0 for a skipped step, else 0.0 (the ``grad_nonfinite_skipped`` metric)."""
    if math.isfinite(grad_norm):
        optimizer.step()
        return 0.0
    return 1.0


def use_configured_hyperparameters(optimizer: torch.optim.Optimizer, lr: float, train_cfg) -> None:
    """After an AdamW's state is loaded from a checkpoint: the lr, betas and weight decay of the run's config, not
    the ones the checkpoint was saved with, which loading the state put back (a resume given another
    train.weight_decay silently went on with the old one). A trainer's lr is set again at every step anyway."""
    for group in optimizer.param_groups:
        group.update(lr=lr, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2), weight_decay=train_cfg.weight_decay)


class Trainer(Protocol):
    model: torch.nn.Module

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per response token logprobs [N, T] under the current weights, without grad (zeros on padding)."""

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[N, T] logprobs under the frozen reference model (the initial weights), without grad.
        Called by the loop when algorithm.kl_coef > 0."""

    def reset_reference(self) -> None:
        """Make the KL reference a frozen copy of the current weights (called as RL starts)."""

    # True if train_step accepts batch.old_logprobs=None (see train_step); the loop then skips the
    # separate old-policy pass where it may (train.old_logprobs=auto)
    on_policy_old_logprobs: bool

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over ``batch`` (split into micro-batches), returning metrics.

        With ``batch.old_logprobs is None`` the loss sees the forward's own logprobs, detached, as the
        old ones (the weights do not change within the step, so they are what a separate pass would
        give), and the metrics include mismatch_kl, mismatch_k1 and mismatch_abs (engine vs trainer) when
        ``batch.rollout_logprobs`` is given."""

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The current weights to push to rollout engines (names as in the model)."""

    def save(self, path: Path) -> None:
        """Write the resumable training state (model, optimizer, scheduler, reference model) into
        the folder ``path``; called on every rank. The loop makes the checkpoint atomic."""

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote."""

    def export_hf(self, family, dest: Path, extra_files: dict[str, str] | None = None) -> None:
        """Write the policy as an HF safetensors folder (called on every rank; one writes)."""
