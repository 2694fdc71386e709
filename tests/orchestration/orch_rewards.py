"""A dense reward for the Ray equivalence test: the share of digits in the response (varies per sample)."""


def digit_share(sample) -> float:
    text = sample.response
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def slow_ahead(sample) -> float:
    """A slow verifier (1 s a sample) in the one_step_off generation running ahead; at once elsewhere (a short test)."""
    import threading
    import time

    if threading.current_thread().name.startswith("miles-rollout"):
        time.sleep(1.0)
    return 0.0
