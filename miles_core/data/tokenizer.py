"""Tokenizers behind one small interface: a character tokenizer for the tiny built-in models,
and HF tokenizers (``tokenizer.json`` in a checkpoint folder) for real ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from miles_core.errors import ConfigError, DataError

CHAR_TOKENIZER_FILE = "miles_char_tokenizer.json"
DEFAULT_ALPHABET = "0123456789+-*=()<>?:,. abcdefghijklmnopqrstuvwxyz"


class Tokenizer(Protocol):
    pad_token_id: int
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """One id per character; ids 0..2 are <pad>, <eos>, <unk>."""

    SPECIALS = ("<pad>", "<eos>", "<unk>")

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        self.alphabet = alphabet
        self._to_id = {ch: i + len(self.SPECIALS) for i, ch in enumerate(alphabet)}
        self.pad_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2
        self.vocab_size = len(self.SPECIALS) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        return [self._to_id.get(ch, self.unk_token_id) for ch in text]

    def decode(self, ids: list[int]) -> str:
        n = len(self.SPECIALS)
        return "".join(self.alphabet[i - n] for i in ids if i >= n)

    def to_json(self) -> str:
        return json.dumps({"type": "char", "alphabet": self.alphabet})


def hf_eos_token_ids(path: Path) -> list[int]:
    """The end-of-sequence ids an HF folder's ``config.json`` and ``generation_config.json`` name (each an int or a
    list). Chat models end a turn with ids the tokenizer's one eos does not name (Llama 3 Instruct's <|eot_id|>, Qwen's
    <|endoftext|> beside <|im_end|>); SGLang stops on all of them, so a server that does not runs on past them."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = Path(path) / name
        if not file.is_file():
            continue
        try:
            cfg = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}: not valid JSON ({exc})") from None
        eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and not isinstance(t, bool) and t not in ids:
                ids.append(t)
    return ids


class HFTokenizer:
    """A transformers tokenizer loaded from a checkpoint folder (offline)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # its message may run over several lines: the CLI prints one
            raise ConfigError(f"cannot load a tokenizer from '{path}': {' '.join(str(exc).split())}") from None
        self._setup()
        self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *hf_eos_token_ids(path)]))
        if self.eos_token_id is None and self.stop_token_ids:  # the tokenizer names none: the model's own ends responses
            self.eos_token_id = self.stop_token_ids[0]
            self.pad_token_id = self.eos_token_id if self.pad_token_id is None else self.pad_token_id
        gen = Path(path) / "generation_config.json"
        self._generation_config = gen.read_bytes() if gen.is_file() else None

    @classmethod
    def wrap(cls, tok) -> HFTokenizer:
        """Wrap a transformers tokenizer object that is already loaded (e.g. read from a GGUF file)."""
        self = cls.__new__(cls)
        self.tok = tok
        self._setup()
        return self

    def files(self) -> dict[str, bytes]:
        """The tokenizer's files as ``save_pretrained`` writes them, to be saved beside a checkpoint's weights: a
        checkpoint that --resume or ``miles serve`` builds from reads its tokenizer from its own folder. With them the
        model's ``generation_config.json`` (its own, or one naming the stop ids): the saved ``config.json`` holds no
        eos ids, and without it a resumed run or an exported model would stop on the tokenizer's eos alone."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            self.tok.save_pretrained(tmp)
            files = {f.name: f.read_bytes() for f in Path(tmp).iterdir() if f.is_file()}
        if self._generation_config is not None:
            files["generation_config.json"] = self._generation_config
        elif self.stop_token_ids != [self.eos_token_id]:
            files["generation_config.json"] = json.dumps({"eos_token_id": self.stop_token_ids}).encode()
        return files

    def _setup(self) -> None:
        self.eos_token_id = self.tok.eos_token_id
        # the ids that end a response: the tokenizer's eos and those the model's config files name (HFTokenizer(path))
        self.stop_token_ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self._generation_config: bytes | None = None
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled ``text`` (``"<|im_end|>"``), which :meth:`decode` leaves out; else None."""
        for i, added in self.tok.added_tokens_decoder.items():
            if added.special and added.content == text:
                return i
        return self.tok.convert_tokens_to_ids(text) if text in self.tok.all_special_tokens else None

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """``messages`` through the tokenizer's chat template, ending with the assistant's turn
        opened (``add_generation_prompt=True``); without a template, the last message's text. A template that
        raises on them (a role it does not support) is a DataError naming the roles."""
        if not getattr(self.tok, "chat_template", None):
            return messages[-1]["content"]
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template that refuses the messages (Gemma's: "System role not supported")
            roles = [m.get("role") for m in messages]
            hint = ("; for a model without a system role leave the system message out (reasoning_gym: "
                    "data.task_options.system_prompt: '')" if "system" in roles else "")
            raise DataError(f"the tokenizer's chat template cannot render messages with roles [{', '.join(map(str, roles))}]: "
                            f"{type(exc).__name__}: {' '.join(str(exc).split())}{hint}") from None


def missing_folder(path: Path) -> str:
    """Why ``path`` is not a model folder: absent, or a file (the weights file itself, a .gguf with another suffix)."""
    if path.is_file():
        return f"model checkpoint '{path}' is a file; give the HF folder that holds it (or a .gguf file)"
    return f"model checkpoint '{path}' does not exist"


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The tokenizer of a checkpoint folder, or the default character tokenizer."""
    if path is None:
        return CharTokenizer()
    path = Path(path)
    if not path.is_dir():  # else transformers takes the path for a hub repo id and answers about its form
        raise ConfigError(missing_folder(path))
    char_file = path / CHAR_TOKENIZER_FILE
    if char_file.is_file():
        return CharTokenizer(json.loads(char_file.read_text())["alphabet"])
    return HFTokenizer(path)
