"""Loss aggregation over a global batch, exact under any split into micro-batches.

``token_loss`` and ``mask`` are [n, T] for one micro-batch; ``num_tokens`` / ``num_seqs`` count
the whole global batch (one optimizer step), so summing the micro-batch results gives the loss
of the global batch.

* ``token_mean``: sum(l * m) / num_tokens  (DAPO; every token weighs the same)
* ``seq_mean_token_mean``: sum_i [sum_t l_it m_it / len_i] / num_seqs  (the original GRPO)
* ``seq_sum``: sum(l * m) / (num_seqs * C)  (Dr.GRPO; C = loss_agg_constant, else ``max_len``, which the trainers
  pass as the generation budget rollout.max_response_len, or the batch's width where a loaded response is longer:
  a constant, as Dr.GRPO's MAX_TOKENS, so a step's loss scale does not follow its longest response)
"""

from __future__ import annotations

import torch

from miles_core.algorithms.config import AlgorithmConfig


def agg_length(cfg, batch) -> int:
    """``seq_sum``'s default per-sequence divisor: the generation budget (``cfg.rollout.max_response_len``), or the
    batch's response width where it is wider (saved rollouts made with a larger budget)."""
    return max(cfg.rollout.max_response_len, batch.response_mask.shape[1])


def aggregate_loss(
    token_loss: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig, num_tokens: int, num_seqs: int, max_len: int
) -> torch.Tensor:
    if cfg.loss_agg == "token_mean":
        return (token_loss * mask).sum() / max(num_tokens, 1)
    if cfg.loss_agg == "seq_mean_token_mean":
        per_seq = (token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(num_seqs, 1)
    if cfg.loss_agg == "seq_sum":
        constant = cfg.loss_agg_constant or max_len
        return (token_loss * mask).sum() / (max(num_seqs, 1) * constant)
    raise ValueError(f"unknown loss aggregation '{cfg.loss_agg}'")
