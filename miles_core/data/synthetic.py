"""Built-in synthetic tasks with exact verifiers; they need no files and no download.

* ``addition``: "23+58=" -> "81"; options ``max_value`` (operands in 0..max_value).
* ``reverse``: "abc?" -> "cba"; options ``min_len``, ``max_len``, ``alphabet``.

Both take ``demo_noise`` (default 0): the fraction of supervised warm-up demonstrations that a
*flawed teacher* gets wrong in a systematic way (addition: off by one; reverse: the string copied
instead of reversed). The verifier is always exact, so RL can find and fix what the teacher taught.

The eval set is drawn with its own fixed seed and is excluded from the training stream.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from miles_core.errors import ConfigError
from miles_core.types import Prompt

EVAL_SEED = 1234567


def _int_option(options: dict[str, Any], key: str, default: int, low: int) -> int:
    value = options.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"data.task_options.{key} must be an integer >= {low}, got {value!r}")
    return value


class _SyntheticTask:
    name = "synthetic"

    def __init__(self, num_eval: int, demo_noise: float = 0.0) -> None:
        self.num_eval = num_eval
        self.demo_noise = demo_noise
        self._demo_rng = random.Random(EVAL_SEED + 1)
        self._eval = self._draw(random.Random(EVAL_SEED), num_eval, exclude=set())
        self._eval_texts = {p.text for p in self._eval}

    def _make(self, rng: random.Random) -> Prompt:
        raise NotImplementedError

    def _draw(self, rng: random.Random, n: int, exclude: set[str]) -> list[Prompt]:
        out, seen = [], set(exclude)
        for _ in range(100 * n):
            if len(out) == n:
                break
            p = self._make(rng)
            if p.text not in seen:
                seen.add(p.text)
                out.append(p)
        return out

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def train_prompts(self, rng: random.Random) -> Iterator[Prompt]:
        while True:
            p = self._make(rng)
            if p.text not in self._eval_texts:
                yield p

    def score(self, response: str, label: object) -> float:
        return 1.0 if response.strip() == str(label) else 0.0

    def reference(self, prompt: Prompt) -> str | None:
        if self.demo_noise and self._demo_rng.random() < self.demo_noise:
            return self._flawed(prompt)
        return str(prompt.label)

    def _flawed(self, prompt: Prompt) -> str:
        raise NotImplementedError


class AdditionTask(_SyntheticTask):
    name = "addition"

    def __init__(self, num_eval: int, max_value: int = 99, demo_noise: float = 0.0) -> None:
        self.max_value = max_value
        if (max_value + 1) ** 2 < 2 * num_eval:
            raise ConfigError(f"data.task_options.max_value={max_value} leaves too few problems for {num_eval} eval prompts")
        super().__init__(num_eval, demo_noise)

    def _flawed(self, prompt: Prompt) -> str:
        return str(int(prompt.label) + 1)

    def _make(self, rng: random.Random) -> Prompt:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        return Prompt(text=f"{a}+{b}=", label=str(a + b))


class ReverseTask(_SyntheticTask):
    name = "reverse"

    def __init__(
        self, num_eval: int, min_len: int = 2, max_len: int = 5, alphabet: str = "abcde", demo_noise: float = 0.0
    ) -> None:
        if min_len > max_len:
            raise ConfigError(f"data.task_options.min_len ({min_len}) must be <= max_len ({max_len})")
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet
        distinct = 0  # strings there are (up to what the check needs): the eval set must leave some to train on
        for n in range(min_len, max_len + 1):
            distinct += len(set(alphabet)) ** n
            if distinct >= 2 * num_eval:
                break
        else:
            raise ConfigError(f"data.task_options: task 'reverse' has {distinct} distinct strings (alphabet {alphabet!r}, "
                              f"lengths {min_len}..{max_len}), too few for {num_eval} eval prompts and training "
                              "(it needs twice as many): raise max_len, widen the alphabet or lower data.num_eval")
        super().__init__(num_eval, demo_noise)

    def _flawed(self, prompt: Prompt) -> str:
        return prompt.text[:-1]  # copied, not reversed

    def _make(self, rng: random.Random) -> Prompt:
        s = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Prompt(text=f"{s}?", label=s[::-1])


def _noise_option(options: dict[str, Any]) -> float:
    value = options.get("demo_noise", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(f"data.task_options.demo_noise must be a number in [0, 1), got {value!r}")
    return float(value)


def addition_factory(cfg) -> AdditionTask:
    opts = dict(cfg.task_options)
    unknown = set(opts) - {"max_value", "demo_noise"}
    if unknown:
        raise ConfigError(
            f"data.task_options: unknown option(s) {sorted(unknown)} for task 'addition' (valid: max_value, demo_noise)"
        )
    return AdditionTask(cfg.num_eval, _int_option(opts, "max_value", 99, 1), _noise_option(opts))


def reverse_factory(cfg) -> ReverseTask:
    opts = dict(cfg.task_options)
    unknown = set(opts) - {"min_len", "max_len", "alphabet", "demo_noise"}
    if unknown:
        raise ConfigError(
            f"data.task_options: unknown option(s) {sorted(unknown)} for task 'reverse' "
            "(valid: min_len, max_len, alphabet, demo_noise)"
        )
    alphabet = opts.get("alphabet", "abcde")
    if not isinstance(alphabet, str) or not alphabet:
        raise ConfigError(f"data.task_options.alphabet must be a non-empty string, got {alphabet!r}")
    return ReverseTask(
        cfg.num_eval, _int_option(opts, "min_len", 2, 1), _int_option(opts, "max_len", 5, 1), alphabet, _noise_option(opts)
    )
