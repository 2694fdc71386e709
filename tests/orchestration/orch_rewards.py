"""A dense reward for the Ray equivalence test: the share of digits in the response (varies per sample)."""


def digit_share(sample) -> float:
    text = sample.response
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)
