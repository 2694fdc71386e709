from __future__ import annotations

from collections.abc import Awaitable, Callable

from miles_core.types import Sample

# A reward function takes one sample (prompt, response, label, metadata) and returns a float,
# or an awaitable of one (async verifiers, environments). It runs under reward.timeout_s.
RewardFn = Callable[[Sample], "float | Awaitable[float]"]
