"""A reward for the PPO end-to-end test: +1 for a correct answer, -1 otherwise.

With rewards in {0, 1} and a critic that starts at V = 0, the first value loss is already tiny
(most returns are 0); signed rewards give the critic something to learn from the first step.
"""


def signed(sample) -> float:
    return 1.0 if sample.label is not None and sample.response.strip() == str(sample.label) else -1.0
