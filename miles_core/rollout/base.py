"""The rollout backend interface: generate samples, take new weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from miles_core.types import Prompt, Sample


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's eos
    stop: list[str] = field(default_factory=list)  # stop strings, checked on the decoded response
    seed: int | None = None  # per request; None = the backend's generator
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the top probability
    ignore_eos: bool = False  # keep generating past the tokenizer's eos (stop_token_ids still stop)
    top_logprobs: int = 0  # also return the top-k logprobs at each position (0 = off)


class RolloutBackend(Protocol):
    weight_version: int  # the version of the weights it holds

    def generate(self, prompts: list[Prompt], params: SamplingParams, n: int = 1) -> list[Sample]:
        """``n`` samples per prompt, grouped: samples ``i*n .. i*n+n-1`` answer prompt ``i``.

        Each sample carries the sampled token ids, the logprob of each under the sampling
        distribution (logits / temperature, before top-p/top-k), the finish reason and the
        weight version.
        """

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights (a full state dict, names as in the model) and report ``version``."""

    def shutdown(self) -> None: ...
