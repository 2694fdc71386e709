"""Tasks: where prompts come from, and how a response is checked."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Protocol

from miles_core.types import Prompt


class Task(Protocol):
    """A task may also have ``data_fingerprint``: a JSON-able dict that identifies the data its training stream is
    drawn from (the JSONL task: the file's path, size and sha256). A checkpoint records it, and a resume refuses to
    replay the stream if it differs (``data.allow_changed_on_resume``). Optional: a task whose stream is a function
    of its seed and options alone has none."""

    name: str

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts; never served by :meth:`train_prompts`."""

    def train_prompts(self, rng: random.Random) -> Iterator[Prompt]:
        """An endless stream of training prompts (a file is replayed epoch after epoch, reshuffled)."""

    def score(self, response: str, label: object) -> float:
        """The verifier: 1.0 for a correct response, 0.0 for a wrong one (partial credit allowed)."""

    def reference(self, prompt: Prompt) -> str | None:
        """A correct response for supervised warm-up, or None if the task has none."""
