"""A real transformers tokenizer built in memory (no model hub), for tests of code that needs one: chat templates,
special tokens, characters split across byte-level tokens."""

from __future__ import annotations

# a chat template that refuses a system turn, as Gemma's do ("System role not supported")
GEMMA_LIKE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
              "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")


def byte_level_bpe(corpus: str, special_tokens: tuple[str, ...] = ("<eos>",), eos: str | None = "<eos>",
                   chat_template: str | None = None, repeat: int = 20, vocab_size: int = 300):
    """A GPT-2 style byte-level BPE (every byte is a token) trained on ``corpus`` repeated ``repeat`` times, as a
    ``PreTrainedTokenizerFast`` with ``eos`` as its eos token (None: it names none) and ``chat_template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([corpus] * repeat, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, **({"eos_token": eos} if eos is not None else {}))
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
