from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_core.errors import ConfigError


@dataclass
class DataConfig:
    task: str = "addition"  # a registered task; "jsonl" reads train_path / eval_path
    task_options: dict[str, Any] = field(default_factory=dict)  # passed to the task's factory
    train_path: str | None = None  # JSONL prompts for training (task=jsonl)
    eval_path: str | None = None  # JSONL prompts for held-out eval (task=jsonl)
    prompt_key: str = "prompt"  # JSONL key of the prompt text
    label_key: str = "label"  # JSONL key of the reference answer
    response_key: str = "response"  # JSONL key of the target response (run.mode=sft)
    num_eval: int = 128  # held-out prompts per eval (synthetic tasks)
    # a resume replays the prompt order from the checkpoint's position; if the training file changed since, it refuses
    # unless this is true (then the new file's order is replayed from that position)
    allow_changed_on_resume: bool = False

    def validate(self) -> None:
        if self.num_eval < 1:
            raise ConfigError(f"data.num_eval must be >= 1, got {self.num_eval}")
