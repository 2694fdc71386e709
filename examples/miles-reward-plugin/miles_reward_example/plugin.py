"""Registers the reward ``digits_match``: partial credit for each correct digit of the answer.

Use it with ``miles run reward.name=digits_match``.
"""

from miles_core.hookspecs import hookimpl


def digits_match(sample) -> float:
    """Fraction of the label's characters that the response gets right, position by position."""
    label, response = str(sample.label), sample.response.strip()
    if not label:
        return 0.0
    hits = sum(a == b for a, b in zip(label, response))
    return hits / max(len(label), len(response))


@hookimpl
def miles_register_rewards(registry):
    registry.add("digits_match", digits_match)
