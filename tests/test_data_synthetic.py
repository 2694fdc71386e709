"""The built-in synthetic tasks: option checks and the held-out split."""

import itertools
import random

import pytest

from miles_core.data.config import DataConfig
from miles_core.data.synthetic import reverse_factory
from miles_core.errors import ConfigError


def test_reverse_refuses_options_whose_strings_the_eval_set_would_use_up():
    """max_len=2 over 'abcde' gives 25 strings; data.num_eval=128 put all 25 in the eval set, and the training
    stream, which skips eval strings, then drew forever without yielding a prompt (the run hung at step 1)."""
    with pytest.raises(ConfigError, match=r"^data.task_options: task 'reverse' has 25 distinct strings "
                                          r"\(alphabet 'abcde', lengths 2..2\), too few for 128 eval prompts"):
        reverse_factory(DataConfig(task="reverse", num_eval=128, task_options={"max_len": 2}))
    with pytest.raises(ConfigError, match="has 6 distinct strings"):  # a repeated letter adds no string
        reverse_factory(DataConfig(task="reverse", num_eval=4, task_options={"alphabet": "aab", "min_len": 1, "max_len": 2}))
    task = reverse_factory(DataConfig(task="reverse", num_eval=12, task_options={"max_len": 2}))
    held_out = {p.text for p in task.eval_prompts()}
    train = {p.text for p in itertools.islice(task.train_prompts(random.Random(0)), 500)}
    assert len(held_out) == 12 and len(train) == 25 - 12 and not held_out & train
