"""Built-in rewards (besides "task", which is the selected task's own verifier)."""

from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry
from miles_core.types import Sample


def _label_text(sample: Sample, reward: str) -> str | None:
    """The label as the text these rewards compare with, or None (no label). A structured label (reasoning_gym's dataset
    entry, a JSONL list of answers) is an error: its str() is in no response, so every sample would score 0.0."""
    label = sample.label
    if label is None:
        return None
    if not isinstance(label, (str, int, float)):
        raise ValueError(f"the label is a {type(label).__name__}, not a text or number ({label!r:.60}): {reward} compares "
                         "the response with it as text; use reward.name=task (the task's verifier) or a reward of your own")
    return str(label)


def exact_match(sample: Sample) -> float:
    label = _label_text(sample, "exact_match")
    return 1.0 if label is not None and sample.response.strip() == label.strip() else 0.0


def contains_answer(sample: Sample) -> float:
    label = _label_text(sample, "contains_answer")
    if label is None:
        return 0.0
    answer = label.strip()
    if not answer:  # '' is in every response: each would score 1.0
        raise ValueError(f"the label is empty ({sample.label!r}): every response contains it")
    return 1.0 if answer in sample.response else 0.0


@hookimpl
def miles_register_rewards(registry: Registry) -> None:
    registry.add("exact_match", exact_match)
    registry.add("contains_answer", contains_answer)
