"""Token sampling: temperature, top-k, top-p, with the logprob of the chosen token."""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [B, V] -> (token ids [B], logprobs [B]).

    The logprob is taken under softmax(logits / temperature), before top-k/top-p truncation (the
    distribution the trainer recomputes); with temperature 0 (greedy) it is under softmax(logits).
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, -1)
    filtered = scaled
    if top_k > 0 and top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(filtered, -1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
