"""Per-token logprobs and entropy when the LM head is split over the vocabulary (tensor parallel).

Rank r holds rows [v0, v0 + V/tp) of the head ``W``; with z = h W^T / temperature (fp32), for a
chunk of tokens:

    m   = max over all ranks of z                   (all-reduce MAX, no grad: a shift only)
    S   = sum_ranks sum_v exp(z_v - m)               (all-reduce SUM)
    lse = log S + m
    logp(y) = z_y - lse                              (z_y lives on one rank; all-reduce SUM of a masked gather)
    H   = lse - sum_ranks sum_v softmax(z)_v z_v     (entropy)

The sums go through Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
identity backward), so each rank's gradient w.r.t. its own logits is exact; the caller passes
``hidden`` through ``copy_to_tensor_model_parallel_region`` so that dL/dhidden is summed over ranks. Rows at or past
``vocab_size`` (padding so that tp divides the vocab) are masked to -inf. Like
:func:`miles_core.kernels.logprobs.logprobs_torch`, chunks of ``chunk_size`` tokens are
recomputed in backward, so the [tokens, V/tp] fp32 logits never exist whole.
At tp = 1 the reductions are identities and this equals ``logprobs_torch`` up to rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


def _chunk(hidden, weight, targets, vocab_start: int, vocab_size: int, temperature: float, group):
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    logits = (hidden @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    cols = vocab_start + torch.arange(weight.shape[0], device=logits.device)
    pad = cols >= vocab_size
    logits = logits.masked_fill(pad, float("-inf"))
    mx = logits.detach().max(-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    e = (logits - mx[:, None]).exp()
    s = reduce(e.sum(-1), group=group)
    lse = s.log() + mx
    local = targets - vocab_start
    mine = (local >= 0) & (local < weight.shape[0])
    z_y = logits.gather(-1, local.clamp(0, weight.shape[0] - 1)[:, None]).squeeze(-1)
    z_y = reduce(torch.where(mine, z_y, torch.zeros_like(z_y)), group=group)
    p_z = (e / s[:, None] * logits.masked_fill(pad, 0.0)).sum(-1)
    entropy = lse - reduce(p_z, group=group)
    return z_y - lse, entropy


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    temperature: float = 1.0,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` [M, H], ``weight`` [V/tp, H] (this rank's rows), ``targets`` [M] (global ids).
    Returns ``(logprobs [M], entropy [M])`` in fp32."""
    lps, ents = [], []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for start in range(0, hidden.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        args = (hidden[sl], weight, targets[sl], vocab_start, vocab_size, temperature, group)
        lp, ent = checkpoint(_chunk, *args, use_reentrant=False) if needs_grad else _chunk(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(lps), torch.cat(ents)
