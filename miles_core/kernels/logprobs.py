"""Reference op "logprobs": per-token log-probabilities and entropy from hidden states.

The [tokens, vocab] logits are made one chunk of tokens at a time, and each chunk is recomputed
in backward (checkpointed), so the full fp32 [tokens, vocab] tensor never exists at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = (hidden @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def logprobs_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` [M, H], ``weight`` [V, H] (the LM head), ``targets`` [M] int64.

    Returns ``(logprobs [M], entropy [M])`` in fp32, of ``softmax(hidden @ weight.T / temperature)``.
    """
    outs_lp, outs_ent = [], []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        if needs_grad and hidden.shape[0] > chunk_size:
            lp, ent = checkpoint(_chunk, hidden[sl], weight, targets[sl], temperature, use_reentrant=False)
        else:
            lp, ent = _chunk(hidden[sl], weight, targets[sl], temperature)
        outs_lp.append(lp)
        outs_ent.append(ent)
    if not outs_lp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(outs_lp), torch.cat(outs_ent)
