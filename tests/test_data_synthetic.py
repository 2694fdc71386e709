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


def _build(*overrides):
    from miles_core.config.loader import load_config
    from miles_core.orchestration.build import build
    from miles_core.plugins.manager import MilesPlugins

    return build(load_config(None, list(overrides)), MilesPlugins(), None)


def test_characters_the_built_in_tokenizer_lacks_are_named_at_start_up(tmp_path):
    """The tiny models' character tokenizer encoded a character outside its alphabet as <unk> and decodes none back:
    a reverse alphabet with uppercase letters (or a JSONL file's) trained on <unk> prompts towards answers no
    response could spell, reward 0 throughout and no error."""
    import json

    from miles_core.errors import DataError

    with pytest.raises(ConfigError, match=r"^data.task_options.alphabet 'abXY' has characters the built-in character "
                                          r"tokenizer does not: 'X', 'Y' \(its alphabet: '0123456789.*xyz'\)"):
        _build("data.task=reverse", "data.task_options.alphabet=abXY", "data.num_eval=4")
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(json.dumps({"prompt": "ab?", "label": "ba"}) + "\n" + json.dumps({"prompt": "Ab?", "label": "bA"}) + "\n")
    held_out.write_text(json.dumps({"prompt": "cd?", "label": "d_C"}) + "\n")
    jsonl = ("data.task=jsonl", f"data.train_path={train}", f"data.eval_path={held_out}")
    with pytest.raises(DataError, match=f"^{train}:2: the prompt 'Ab\\?' has characters the built-in character tokenizer "
                                        "does not: 'A' "):
        _build(*jsonl)
    train.write_text(json.dumps({"prompt": "ab?", "label": "ba"}) + "\n")
    with pytest.raises(DataError, match=f"^{held_out}:1: the answer 'd_C' has characters the built-in "
                                        r"character tokenizer does not: 'C', '_' \(its alphabet"):
        _build(*jsonl)
    held_out.write_text(json.dumps({"prompt": "cd?", "label": "dc"}) + "\n")
    assert _build(*jsonl).task.eval_prompts()[0].label == "dc"
    assert _build("data.task=reverse", "data.task_options.alphabet=ab?", "data.num_eval=4").task.name == "reverse"


def test_the_start_up_character_check_draws_no_flawed_demonstration():
    """The character check read every held-out prompt's reference answer, and the reverse task's references draw from
    its flawed-teacher generator (demo_noise): the warm-up then saw other demonstrations than the task's own stream
    (the quickstart started RL at 0.125 held-out accuracy instead of 0.065)."""
    opts = "data.task_options={demo_noise: 0.6}"
    built = _build("data.task=reverse", opts).task
    fresh = reverse_factory(DataConfig(task="reverse", task_options={"demo_noise": 0.6}))
    prompts = fresh.eval_prompts()[:50]
    assert [built.reference(p) for p in prompts] == [fresh.reference(p) for p in prompts]
