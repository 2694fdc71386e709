"""Incremental detokenization for streamed answers: each event decodes a bounded window of recent tokens,
not the whole output again (which made a long stream quadratic in its length).

The technique is the one of vLLM's and TGI's incremental detokenizers, written anew here. Text is
*committed* once the decoded window no longer ends in U+FFFD (an incomplete UTF-8 sequence: a
multi-byte character split across tokens); the window restarts at the previous commit point, so a
decoder that treats the first token of a string specially (SentencePiece's leading space) sees the
same context in both decodes whose difference is the new text. The uncommitted rest is *pending*:
its text as the window decodes it, trailing U+FFFD included, so committed + pending equals the full
decode of the ids at every step.

That equality holds for decoders that are local at character boundaries: byte-level BPE (GPT-2's,
SmolLM2's, Llama 3's, Qwen's), the character tokenizer. A byte-fallback decoder (SentencePiece's
<0xNN> tokens) turns a whole run of byte tokens into U+FFFD when the run as a whole is not valid
UTF-8: while a character is unfinished, the full decode shows every character of its run as U+FFFD,
and a bad byte changes characters committed before it. No bounded window can follow that; there the
equality holds wherever the run's characters are whole. The server's final event decodes the whole
output once, so a stream ends on exactly the non-streamed answer's text whatever the tokenizer.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Decodes a growing list of token ids, a bounded window of ids per :meth:`push`.

    ``decode(ids) -> str`` is the tokenizer's. ``max_held``: how many tokens may wait behind an incomplete
    character before :meth:`_force` looks for an earlier boundary to commit at (at least 3, the most bytes an
    unfinished character has); without it, a model emitting invalid bytes would grow the window, and each
    decode with it, without end."""

    def __init__(self, decode: Callable[[list[int]], str], max_held: int = 8) -> None:
        self._decode = decode
        self.max_held = max_held
        self._ids: list[int] = []  # the window's ids: from the commit point before the last one on (see _commit)
        self._read = 0  # ids before this index (within the window) have their text committed
        self._prefix_text = ""  # decode(ids[:read]): the context whose text the window's decode starts with
        self.pending = ""  # the text of ids[read:] as the window decodes it (may end in U+FFFD)
        self._quiet = 0  # text-less tokens committed since the window last restarted (see _commit)

    def push(self, ids: Iterable[int]) -> str:
        """Add ``ids``; -> the text they (with those held before) commit, "" while it may still change."""
        self._ids.extend(ids)
        window = self._decode(self._ids)
        if not window.endswith(REPLACEMENT):
            return self._commit(len(self._ids), window)
        if len(self._ids) - self._read > self.max_held:
            return self._force(window)
        self.pending = window[len(self._prefix_text):]
        return ""

    def _commit(self, upto: int, head: str) -> str:
        """Commit the text of ids[read:upto] (``head``: the window's decode up to ``upto``). The window restarts at the
        old read point, so its decode starts with the text just committed as context, unless those tokens show no
        text alone (special tokens, a lone "▁" whose space a SentencePiece decoder strips at the start): a window
        starting there would strip the next piece's leading space, which the full decode keeps. Past
        ``4 * max_held`` tokens of such, it restarts anyway: bounded work first."""
        new = head[len(self._prefix_text):]
        context = self._decode(self._ids[self._read:upto])
        quiet = 0 if context else self._quiet + upto - self._read
        if context or quiet > 4 * self.max_held:
            self._ids, upto, self._prefix_text = self._ids[self._read:], upto - self._read, context
            quiet = 0
        else:
            self._prefix_text = head
        self._quiet = quiet
        self._read = upto
        self.pending = "" if upto == len(self._ids) else self._decode(self._ids)[len(self._prefix_text):]
        return new

    def _force(self, window: str) -> str:
        """Too many tokens wait behind U+FFFD: commit up to an earlier token boundary, keeping the window bounded.
        Preferred: the last one where the text is whole (pushes that keep ending inside characters, as 4-token steps
        over 3-byte characters of a byte-fallback tokenizer do); else the last one whose text the tokens after it
        confirm (the window's text starts with it and goes on past it: the bytes it left unfinished were invalid,
        or U+FFFD itself). With neither (characters straddling every token boundary: real text does so for a token
        or two), hold on, up to ``4 * max_held`` tokens; past that, commit anyway: bounded work before exactness."""
        confirmed = None
        for upto in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._ids[:upto])
            if not head.endswith(REPLACEMENT):
                return self._commit(upto, head)
            if confirmed is None and len(window) > len(head) and window.startswith(head):
                confirmed = upto, head
        if confirmed is None and len(self._ids) - self._read <= 4 * self.max_held:
            self.pending = window[len(self._prefix_text):]
            return ""
        return self._commit(*(confirmed or (len(self._ids) - 1, self._decode(self._ids[:-1]))))


class AppendOnlyText:
    """Text that only grows at its end, kept as the pieces appended: a slice near the end costs its own length
    (and a bisect), not the whole text's, so a long stream's per-event work stays bounded."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._starts: list[int] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, piece: str) -> None:
        """Add ``piece`` at the end; empty pieces are not kept, so the pieces' starts stay distinct for the bisect."""
        if piece:
            self._starts.append(self._len)
            self._pieces.append(piece)
            self._len += len(piece)

    def slice(self, start: int, stop: int) -> str:
        """``text[start:stop]`` for 0 <= start, stop."""
        stop = min(stop, self._len)
        if start >= stop:
            return ""
        i = bisect_right(self._starts, start) - 1
        out = []
        while i < len(self._pieces) and self._starts[i] < stop:
            at = self._starts[i]
            out.append(self._pieces[i][max(0, start - at): stop - at])
            i += 1
        return "".join(out)


class StreamText:
    """The text of one request's output as its tokens arrive, as ``MilesServer.text_of`` gives it for the tokens so
    far: ids in ``drop`` (the stop tokens, when the text is trimmed) leave no text; the text ends before the first
    ``stop`` string, or after it with ``keep_stop`` (SGLang's ``no_stop_trim``).

    Stop strings are searched as text is committed (the new text and the ``len(stop) - 1`` characters before it)
    and in the pending tail, so a search never rescans the whole output."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Iterable[str] = (), drop: Iterable[int] = (),
                 keep_stop: bool = False) -> None:
        self._decoder = IncrementalDecoder(decode)
        self._text = AppendOnlyText()  # the committed text
        self._stop = list(stop)
        self._drop = frozenset(drop)
        self._keep_stop = keep_stop
        self._found: dict[str, int] = {}  # stop string -> where it first occurs in the committed text
        self._replacements = 0  # how many U+FFFD end the committed text (bytes that made no character, held back)

    def push(self, ids: Iterable[int]) -> None:
        """Add the next output tokens."""
        ids = [t for t in ids if t not in self._drop]
        if not ids:
            return
        at = len(self._text)
        new = self._decoder.push(ids)
        self._text.append(new)
        if new:
            kept = len(new.rstrip(REPLACEMENT))
            self._replacements = len(new) - kept + (self._replacements if not kept else 0)
        for s in self._stop:
            if s not in self._found:
                start = max(0, at - len(s) + 1)
                i = self._text.slice(start, len(self._text)).find(s)
                if i >= 0:
                    self._found[s] = start + i

    def __len__(self) -> int:
        """The length of the decoded text, before any cut at a stop string."""
        return len(self._text) + len(self._decoder.pending)

    def slice(self, start: int, stop: int) -> str:
        """The decoded text's ``[start:stop]`` (0 <= start, stop)."""
        committed = len(self._text)
        head = self._text.slice(start, stop) if start < committed else ""
        return head + self._decoder.pending[max(0, start - committed): max(0, stop - committed)]

    def end(self) -> int:
        """Where the text ends: before (``keep_stop``: after) the first stop string, else at the end."""
        cuts = [len(self)]
        for s in self._stop:
            i = self._first(s)
            if i >= 0:
                cuts.append(i + len(s) if self._keep_stop else i)
        return min(cuts)

    def before_replacements(self, end: int) -> int:
        """``end`` moved back over the U+FFFD characters just before it. At the end of the committed text this is
        the count kept as text is committed, not a walk over the run: a model emitting invalid bytes makes a run as
        long as its output, which every event would read again."""
        committed = len(self._text)
        if end > committed:
            kept = len(self._decoder.pending[: end - committed].rstrip(REPLACEMENT))
            if kept:
                return committed + kept
            end = committed
        if end == committed:
            return committed - self._replacements
        k = 64  # a cut inside the committed text (before a stop string): read back in growing pieces
        while True:
            start = max(0, end - k)
            kept = len(self._text.slice(start, end).rstrip(REPLACEMENT))
            if kept or start == 0:
                return start + kept
            k *= 2

    def _first(self, s: str) -> int:
        """Where ``s`` first occurs in the decoded text, -1 if nowhere: in the committed text (found as it was
        committed, and earlier than any occurrence reaching into the pending text), else in the pending tail."""
        if s in self._found:
            return self._found[s]
        start = max(0, len(self._text) - len(s) + 1)
        i = self.slice(start, len(self)).find(s)
        return start + i if i >= 0 else -1

    def text(self) -> str:
        """The whole text so far (the payload of a cumulative stream event)."""
        return self.slice(0, self.end())
