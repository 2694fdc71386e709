"""The on-policy distillation teacher (``algorithm.teacher_checkpoint``): loaded, and checked to share the policy's
tokenizer (distillation compares the logprobs of the same token ids)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from miles_core.config.schema import MilesConfig
from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer, HFTokenizer, load_tokenizer
from miles_core.errors import ConfigError
from miles_core.models.checkpoint import load_hf_folder
from miles_core.models.gguf import SMOLLM2_NAMES


def load_teacher(cfg: MilesConfig, families, vocab_size: int, tokenizer=None) -> nn.Module | None:
    if not cfg.algorithm.needs_teacher or cfg.run.mode != "rl":  # sft and rollout score no teacher
        return None
    source = cfg.algorithm.teacher_checkpoint
    if source.lower() in SMOLLM2_NAMES or source.lower().endswith(".gguf"):  # model.hf_checkpoint takes one; a teacher not
        raise ConfigError(f"algorithm.teacher_checkpoint: '{source}' is a GGUF checkpoint; the teacher is read from an "
                          "HF safetensors folder (config.json and *.safetensors): give one")
    path = Path(source)
    try:
        teacher, _ = load_hf_folder(path, families)
    except ConfigError as exc:
        raise ConfigError(f"algorithm.teacher_checkpoint: {exc}") from None
    if teacher.config.vocab_size != vocab_size:
        raise ConfigError(
            f"algorithm.teacher_checkpoint: the teacher's vocab ({teacher.config.vocab_size}) differs from the policy's "
            f"({vocab_size}); distillation needs the same tokenizer"
        )
    if tokenizer is not None:
        check_teacher_tokenizer(path, tokenizer)
    return teacher


_TOKENIZER_FILES = (CHAR_TOKENIZER_FILE, "tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _id_to_token(tokenizer) -> dict[int, str]:
    if isinstance(tokenizer, CharTokenizer):
        return {**dict(enumerate(CharTokenizer.SPECIALS)), **{i: ch for ch, i in tokenizer._to_id.items()}}
    return {i: t for t, i in tokenizer.tok.get_vocab().items()}


def check_teacher_tokenizer(path: Path, tokenizer) -> None:
    """The teacher's tokenizer (when its folder has one) must spell every id that both tokenizers have as the policy's
    does: distillation compares the logprobs of the same ids, and a vocabulary of the same size may still number its
    tokens otherwise (another alphabet's order, another BPE)."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return  # nothing to compare with: the sizes were checked
    try:
        theirs = load_tokenizer(path)
    except ConfigError as exc:
        raise ConfigError(f"algorithm.teacher_checkpoint: {exc}") from None
    if not isinstance(tokenizer, (CharTokenizer, HFTokenizer)):
        return  # a plugin's tokenizer: no vocabulary to read
    if type(theirs) is not type(tokenizer):
        raise ConfigError(f"algorithm.teacher_checkpoint: the tokenizer of '{path}' ({type(theirs).__name__}) is not "
                          f"the policy's ({type(tokenizer).__name__}); distillation needs the same tokenizer")
    mine, other = _id_to_token(tokenizer), _id_to_token(theirs)
    differ = sorted(i for i in mine.keys() & other.keys() if mine[i] != other[i])
    if differ:
        i = differ[0]
        raise ConfigError(f"algorithm.teacher_checkpoint: the tokenizer of '{path}' spells {len(differ)} token ids otherwise "
                          f"than the policy's (id {i}: {other[i]!r} there, {mine[i]!r} in the policy's); distillation "
                          "compares the logprobs of the same ids and needs the same tokenizer")
