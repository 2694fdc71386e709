"""Prompts from JSONL files: one JSON object per line, with configurable prompt and label keys.

Every line is checked when the task is built, so a bad file fails at start-up with its path and
line number, not in the middle of a run. The training file's size and sha256 are taken from the bytes
read (:class:`Fingerprint`), so that a resumed run can tell whether the file changed since its checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

from miles_core.errors import ConfigError, DataError
from miles_core.types import Prompt


class Fingerprint:
    """Size and sha256 of the bytes of a file as they are read: exact for the data actually parsed, and no second
    read of the file (which might already hold something else)."""

    def __init__(self) -> None:
        self.size = 0
        self._sha = hashlib.sha256()

    def update(self, raw: bytes) -> None:
        self.size += len(raw)
        self._sha.update(raw)

    def as_dict(self, path: str) -> dict[str, object]:
        return {"path": path, "size": self.size, "sha256": self._sha.hexdigest()}


def file_fingerprint(path: str) -> dict[str, object]:
    """:class:`Fingerprint` of a whole file (the same figures as one taken while its lines are read)."""
    fingerprint = Fingerprint()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            fingerprint.update(block)
    return fingerprint.as_dict(path)


def read_rows(path: str, fingerprint: Fingerprint | None = None) -> Iterator[tuple[str, object]]:
    """``(where, value)`` for each non-blank line of a JSONL file, ``where`` being ``path:line`` for errors. Each line
    is decoded on its own, so a file saved in another encoding is named with its line (not a traceback); a byte-order
    mark (Windows editors) is skipped. Every line read, blank ones included, goes into ``fingerprint``."""
    if not Path(path).is_file():
        raise DataError(f"data file '{path}' does not exist")
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if fingerprint is not None:
                fingerprint.update(raw)
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg})") from None


def _check_messages(messages: object, where: str) -> None:
    """``messages`` (a chat the loop renders with the model's chat template) checked here, so that a malformed one is
    named with its line at start-up rather than raised by the template mid-run."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: 'messages'[{i}] must be an object with string 'role' and 'content'")


def read_prompts(path: str, prompt_key: str, label_key: str, fingerprint: Fingerprint | None = None) -> list[Prompt]:
    prompts = []
    for where, row in read_rows(path, fingerprint):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if prompt_key not in row:
            raise DataError(f"{where}: missing key '{prompt_key}' (set data.prompt_key)")
        if not isinstance(row[prompt_key], str):
            raise DataError(f"{where}: '{prompt_key}' must be a string")
        meta = {k: v for k, v in row.items() if k not in (prompt_key, label_key)}
        if "messages" in meta:
            _check_messages(meta["messages"], where)
        if not row[prompt_key] and "messages" not in meta:  # no tokens to generate from (messages: the loop renders them)
            raise DataError(f"{where}: '{prompt_key}' is empty")
        if isinstance(row.get(label_key), str) and not row[label_key].strip():  # contained in every response
            raise DataError(f"{where}: '{label_key}' is empty (no answer to check a response against); "
                            "leave the key out for a prompt without one")
        prompts.append(Prompt(text=row[prompt_key], label=row.get(label_key), metadata=meta, source=where))
    if not prompts:
        raise DataError(f"data file '{path}' has no prompts")
    return prompts


class JsonlTask:
    """Prompts from ``data.train_path`` / ``data.eval_path``; the verifier is an exact match with the label (a list
    label: with any of its entries).

    ``data_fingerprint`` identifies the training file (path, size, sha256): the prompt order a resumed run replays
    depends on it. The eval file does not enter it (it changes no training prompt)."""

    name = "jsonl"

    def __init__(self, train_path: str, eval_path: str | None, prompt_key: str, label_key: str) -> None:
        fingerprint = Fingerprint()
        self.train = read_prompts(train_path, prompt_key, label_key, fingerprint)
        self.data_fingerprint = fingerprint.as_dict(train_path)
        self.eval = read_prompts(eval_path, prompt_key, label_key) if eval_path else []

    def eval_prompts(self) -> list[Prompt]:
        return list(self.eval)

    def train_prompts(self, rng: random.Random) -> Iterator[Prompt]:
        order = list(range(len(self.train)))
        while True:
            rng.shuffle(order)
            for i in order:
                yield self.train[i]

    def score(self, response: str, label: object) -> float:
        return 1.0 if response.strip() in _answers(label) else 0.0

    def reference(self, prompt: Prompt) -> str | None:
        answers = _answers(prompt.label)
        return answers[0] if answers else None


def _answers(label: object) -> list[str]:
    """The answers a label accepts: a text or a number is one; a list of them, each (the first is the reference
    answer). Anything else (no label, a custom reward's structure) gives none, so no response matches it."""
    one = lambda v: isinstance(v, (str, int, float))  # noqa: E731 - a bool too: str(True) is "True", as before
    if one(label):
        return [str(label).strip()]
    if isinstance(label, list) and label and all(one(v) for v in label):
        return [str(v).strip() for v in label]
    return []


def jsonl_factory(cfg) -> JsonlTask:
    if not cfg.train_path:
        raise ConfigError("data.task=jsonl needs data.train_path (a JSONL file of prompts)")
    return JsonlTask(cfg.train_path, cfg.eval_path, cfg.prompt_key, cfg.label_key)
