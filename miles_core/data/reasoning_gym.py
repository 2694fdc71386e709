"""Tasks from ``reasoning-gym`` (basic_arithmetic, gsm_symbolic, countdown, ...), scored by the
dataset's own ``score_answer``.

Config: ``data.task: reasoning_gym`` and ``data.task_options``:

* ``dataset`` (required): a reasoning-gym dataset name, e.g. ``basic_arithmetic``;
* ``size`` (default 10000) and ``seed`` (default 1): the training pool;
* ``eval_seed`` (default 2): the held-out pool of ``data.num_eval`` entries, drawn with its own
  seed; an eval question that also occurs in the training pool is dropped from training, so the
  two sets are disjoint as texts, not only as seeds;
* ``system_prompt``: overrides :data:`SYSTEM_PROMPT`; empty: no system turn (chat templates without
  a system role, such as Gemma's, raise on one);
* ``config``: a mapping passed to the dataset's config (e.g. ``{max_terms: 2, max_digits: 2}``).

Each prompt carries ``metadata["messages"]`` (a system turn unless ``system_prompt`` is empty, and a
user turn); the loop renders them with the model tokenizer's chat template (``add_generation_prompt=True``). ``Prompt.text`` is the plain
question until then. The label is the dataset entry itself, which ``score_answer`` needs.

Scoring: the text inside the last ``<answer>...</answer>`` of the response (no tag: the last
number in it; no number: ``None``) goes to ``dataset.score_answer(answer, entry)``: 1.0 for an exact answer, partial credit for an
answer that contains the right one (basic_arithmetic: ``len(oracle) / len(answer)``), else 0.
An answer the scorer raises on is scored 0: some scorers parse it and raise on one they cannot
(prime_factorization's ValueError on "1.5", boxnet's TypeError on "1"), and a policy's unparsable
answer is a wrong one, not the end of the run. Accuracy counts only full marks.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

from miles_core.errors import ConfigError
from miles_core.types import Prompt

SYSTEM_PROMPT = (
    "You are a careful calculator. Solve the problem, then give only the final number "
    "inside <answer></answer> tags, for example <answer>42</answer>."
)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_OPTIONS = {"dataset", "size", "seed", "eval_seed", "system_prompt", "config"}


def extract_answer(response: str) -> str | None:
    """The stripped text of the last ``<answer>...</answer>``; a final unclosed ``<answer>`` counts
    up to the end of the response (generation often stops at the stop string ``</answer>``).
    Without a tag, the last number of the response (SmolLM2-135M rarely writes tags before RL:
    "So, 7 + 5 = 12." -> "12"); None when there is neither."""
    found = ANSWER_RE.findall(response)
    if found:
        return found[-1].strip()
    head, tag, tail = response.rpartition("<answer>")
    if tag:
        return tail.strip()
    numbers = NUMBER_RE.findall(response)
    return numbers[-1] if numbers else None


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError("data.task=reasoning_gym needs the 'reasoning-gym' package: pip install reasoning-gym") from None
    return reasoning_gym


class ReasoningGymTask:
    name = "reasoning_gym"

    def __init__(self, dataset: str, size: int, seed: int, num_eval: int, eval_seed: int,
                 system_prompt: str = SYSTEM_PROMPT, config: dict[str, Any] | None = None) -> None:
        rg = _import_reasoning_gym()
        self.dataset_name, self.system_prompt = dataset, system_prompt
        try:
            self.train_ds = rg.create_dataset(dataset, size=size, seed=seed, **(config or {}))
            self.eval_ds = rg.create_dataset(dataset, size=num_eval, seed=eval_seed, **(config or {}))
        except Exception as exc:  # unknown name, or a config key the dataset rejects
            raise ConfigError(f"data.task_options: reasoning-gym cannot build '{dataset}' with {config or {}}: {exc}") from None
        self._eval = [self._prompt(e) for e in self.eval_ds]
        held_out = {p.label["question"] for p in self._eval}
        self._train = [p for p in map(self._prompt, self.train_ds) if p.label["question"] not in held_out]
        if not self._train:
            raise ConfigError(f"data.task_options: every training entry of '{dataset}' is also held out; raise size or change seed")

    def messages(self, question: str) -> list[dict[str, str]]:
        user = [{"role": "user", "content": question}]
        return [{"role": "system", "content": self.system_prompt}, *user] if self.system_prompt else user

    def _prompt(self, entry: dict[str, Any]) -> Prompt:
        return Prompt(text=entry["question"], label=entry, metadata={"messages": self.messages(entry["question"])})

    @staticmethod
    def _fresh(p: Prompt) -> Prompt:  # the loop fills text/prompt_ids in place: hand out copies
        return Prompt(text=p.text, label=p.label, metadata={"messages": list(p.metadata["messages"])})

    def eval_prompts(self) -> list[Prompt]:
        return [self._fresh(p) for p in self._eval]

    def train_prompts(self, rng: random.Random) -> Iterator[Prompt]:
        order = list(range(len(self._train)))
        while True:
            rng.shuffle(order)
            for i in order:
                yield self._fresh(self._train[i])

    def score(self, response: str, label: object) -> float:
        answer = extract_answer(response)
        try:
            return float(self.train_ds.score_answer(answer, label))
        except Exception:  # noqa: BLE001 - some scorers parse the answer and raise on one they cannot (see module doc)
            return 0.0

    def reference(self, prompt: Prompt) -> str | None:
        """The entry's answer in tags; None where the dataset has no single oracle answer (its 'answer' is None:
        graph_color, boxnet, propositional_logic, rubiks_cube, rush_hour check a response by other means)."""
        answer = prompt.label["answer"]
        return None if answer is None else f"<answer>{answer}</answer>"


def reasoning_gym_factory(cfg) -> ReasoningGymTask:
    opts = dict(cfg.task_options)
    unknown = set(opts) - _OPTIONS
    if unknown:
        raise ConfigError(f"data.task_options: unknown option(s) {sorted(unknown)} for task 'reasoning_gym' (valid: {sorted(_OPTIONS)})")
    if not isinstance(opts.get("dataset"), str):
        raise ConfigError("data.task=reasoning_gym needs data.task_options.dataset (e.g. basic_arithmetic)")
    for key, default in (("size", 10000), ("seed", 1), ("eval_seed", 2)):
        value = opts.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "size" else 0):
            raise ConfigError(f"data.task_options.{key} must be a non-negative integer (size >= 1), got {value!r}")
        opts[key] = value
    if opts["seed"] == opts["eval_seed"]:
        raise ConfigError("data.task_options.seed and eval_seed must differ (the held-out set needs its own seed)")
    config = opts.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(f"data.task_options.config must be a mapping, got {type(config).__name__}")
    return ReasoningGymTask(opts["dataset"], opts["size"], opts["seed"], cfg.num_eval, opts["eval_seed"],
                            opts.get("system_prompt", SYSTEM_PROMPT), config)
