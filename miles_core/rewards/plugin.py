"""Built-in rewards (besides "task", which is the selected task's own verifier)."""

from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry
from miles_core.types import Sample


def exact_match(sample: Sample) -> float:
    return 1.0 if sample.label is not None and sample.response.strip() == str(sample.label).strip() else 0.0


def contains_answer(sample: Sample) -> float:
    if sample.label is None:
        return 0.0
    answer = str(sample.label).strip()
    if not answer:  # '' is in every response: each would score 1.0
        raise ValueError(f"the label is empty ({sample.label!r}): every response contains it")
    return 1.0 if answer in sample.response else 0.0


@hookimpl
def miles_register_rewards(registry: Registry) -> None:
    registry.add("exact_match", exact_match)
    registry.add("contains_answer", contains_answer)
