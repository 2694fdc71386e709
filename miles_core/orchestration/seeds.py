"""Per-sample sampling seeds for deterministic mode.

``seed(run.seed, step, prompt index)`` is a 62-bit hash; the engine gives sample ``i`` of the
prompt's group the seed ``seed + i`` (:meth:`EngineCore.add_request`). The engine's sampler draws
from a counter-based hash of (request seed, output position, vocab id), so a sample's draws
depend only on these four numbers, not on which engine or batch it lands in: one engine in process
and two engines on Ray sample the same tokens (given the same logits).
"""

from __future__ import annotations

import hashlib

SEED_KEY = "sampling_seed"  # Prompt.metadata key the built-in engine reads
INDEX_KEY = "stream_index"  # Prompt.metadata key: the prompt's place in the training stream (0-based)


def prompt_seed(run_seed: int, step: int, prompt_index: int) -> int:
    data = f"{run_seed}:{step}:{prompt_index}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2
