"""Incremental detokenizer: a growing token list -> text deltas, cut at stop strings.

Pure Python over a ``Tokenizer``: the control plane (the engine core) runs it per token.
"""

from __future__ import annotations

from tinyserve.text.tokenizer import Tokenizer


class _StopMatcher:
    """Knuth-Morris-Pratt automaton for one stop string, fed only the text appended since the
    last call.

    ``state`` is the length of the longest suffix of the text fed so far that is a proper prefix
    of the stop string: how much of the tail could still grow into it. Feeding n characters costs
    O(n) amortized: a character raises ``state`` by at most 1 and each failure link followed
    lowers it by at least 1, so over a request the failure walks total at most the characters
    fed (one call may walk up to len(stop) links, paid for by the characters that raised it).
    """

    __slots__ = ("stop", "_fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        # _fail[q]: length of the longest proper border (prefix that is also a suffix) of
        # stop[:q + 1], the state to fall back to when stop[q + 1] does not match.
        fail = [0] * len(stop)
        k = 0
        for q in range(1, len(stop)):
            while k and stop[q] != stop[k]:
                k = fail[k - 1]
            if stop[q] == stop[k]:
                k += 1
            fail[q] = k
        self._fail = fail
        self.state = 0

    def feed(self, text: str) -> int:
        """Advance over ``text``; return the index in it just past the first full match, or -1.

        After a match the automaton is spent (the detokenizer stops), so it is not reset.
        """
        stop, fail, q, n = self.stop, self._fail, self.state, len(self.stop)
        for i, c in enumerate(text):
            while q and stop[q] != c:
                q = fail[q - 1]
            if stop[q] == c:
                q += 1
                if q == n:
                    self.state = q
                    return i + 1
        self.state = q
        return -1

    def restart(self) -> None:
        """Go on after a full match that did not count (before min_tokens): keep the
        longest border, as if that match had failed on its next character."""
        self.state = self._fail[-1]


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, never splitting a UTF-8 character.

    Decodes a short window before the new tokens and emits only the difference, so tokenizers
    that strip or merge spaces at a decode boundary still produce the right text; a window that
    ends in U+FFFD is an unfinished multi-byte character and is held back. Stop strings are cut
    from the text (at the earliest match start over all of them), and text that might be the
    start of a stop string is held back from ``stream_delta`` until it is known not to be one.

    Per call the work is O(new text) amortized, whatever the output length and the stop-string
    lengths: only the new characters go through the stop automata, the held-back length is
    their states, and the text is kept as appended pieces (``text`` joins them on demand)::

        pieces:  | p0 | p1 | p2 ...          | p[-1] |
        text:    |<-- streamed -->|<-- held back: longest partial stop match -->|
                                  ^ _pieces[_sent_piece][_sent_off]
    """

    WINDOW = 5
    MAX_CHAR_TOKENS = 4  # a UTF-8 character spans at most 4 byte tokens; past that, it is invalid

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | tuple[int, ...],
                 stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        self._tok = tokenizer
        pieces = tokenizer.stream_pieces
        self._pieces_of = pieces.text if pieces.enabled else lambda _: None
        self._include_stop = include_stop  # vLLM's include_stop_str_in_output
        self._unchecked = min_tokens  # vLLM: no stop string ends the output before min_tokens
        self._ids = list(prompt_ids)
        self._read = len(self._ids)
        self._complete = self._read  # the ids up to here decode to whole characters
        self._prefix_text: str | None = None  # decode(ids[prefix:read]) once known
        self._skip = skip_special_tokens
        self._special = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._last_plain = False  # the last id is a plain token (the fast path's condition)
        self._prefix = self._char_start(max(len(self._ids) - self.WINDOW, 0))
        # An empty stop string marks no place to stop (the API rejects it); it is ignored.
        self._matchers = [_StopMatcher(s) for s in stop if s]
        self.stopped = False  # a stop string matched
        self.matched: str | None = None  # which one (the earliest match start)
        self._pieces: list[str] = []  # the output text, cut at a matched stop string
        self._len = 0  # total chars in _pieces
        self._joined: str | None = ""  # "".join(_pieces), or None when stale
        self._streamed = 0  # chars handed out by stream_delta
        self._sent_piece = 0  # first piece not wholly streamed ...
        self._sent_off = 0  # ... and how many of its chars were

    def _char_start(self, prefix: int) -> int:
        """Move the prompt's window back to the start of a character (at most 3 tokens): a
        window that starts on a UTF-8 continuation byte decodes to U+FFFD, and byte-fallback
        decoders turn a whole run of byte tokens that is not valid UTF-8 into U+FFFDs, so the
        output's first byte tokens would join that run and come out as U+FFFD too."""
        for _ in range(self.MAX_CHAR_TOKENS - 1):
            if prefix == 0 or not self._tok.decode(self._ids[prefix:self._read],
                                                   self._skip).startswith("\ufffd"):
                break
            prefix -= 1
        return prefix

    @property
    def text(self) -> str:
        """All output text so far, cut at the earliest matched stop string.

        O(len(text)) when it changed since the last read: read it once a request is done.
        """
        if self._joined is None:
            self._joined = "".join(self._pieces)
        return self._joined

    def add(self, token_id: int) -> None:
        """Append one generated token; updates ``text`` and ``stopped``."""
        if self.stopped:
            return
        self._unchecked -= 1
        if token_id in self._special:
            return  # decodes to nothing: kept out of the window, so a run of them costs O(1)
        ids = self._ids
        text = self._pieces_of(token_id)
        last_plain, self._last_plain = self._last_plain, text is not None
        if text is not None and self._complete == self._read == len(ids) and (
                last_plain or (ids and self._pieces_of(ids[-1]) is not None)):
            # plain after plain, nothing held back: a decode would only append its text
            # (stream_pieces.py). The token is the next window's start (decoded alone if that
            # window needs it: a SentencePiece decode strips a leading space)
            ids.append(token_id)
            self._prefix, self._prefix_text = len(ids) - 1, None
            self._read = self._complete = len(ids)
            self._append(text)
            return
        ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        prefix_text = self._prefix_text
        new_text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if new_text.endswith("\ufffd"):
            if len(self._ids) - self._complete < self.MAX_CHAR_TOKENS:
                return  # an unfinished multi-byte character: wait for its other bytes
        else:
            # the decode ends on a whole character: a later U+FFFD counts its bytes from here
            # (not from _read: tokens that added no text, like a lone "▁", are not its bytes)
            self._complete = len(self._ids)
        if len(new_text) <= len(prefix_text):
            return
        piece = new_text[len(prefix_text):]
        # The window keeps its start while it is short: the next call's prefix text is this
        # decode (one decode a token, not two); past WINDOW tokens it starts at the new text.
        if len(self._ids) - self._prefix >= self.WINDOW:
            self._prefix, self._prefix_text = self._read, None
        else:
            self._prefix_text = new_text
        self._read = len(self._ids)
        self._complete = self._read  # (text ending in U+FFFD here is given up as invalid)
        self._append(piece)

    def _append(self, piece: str) -> None:
        start = self._len
        self._pieces.append(piece)
        self._len += len(piece)
        self._joined = None
        if not self._matchers:
            return
        counts = self._unchecked <= 0  # vLLM: stop strings count from the min_tokens-th token
        # Every match ends inside the new piece (an earlier one would have stopped us), and a
        # stop string's first match in it is its earliest start: take the earliest over all.
        cut, keep, matched = -1, 0, None
        for m in self._matchers:
            end, off = m.feed(piece), 0
            while end >= 0 and not counts:  # text of the first tokens: feed, never stop
                m.restart()
                off += end
                end = m.feed(piece[off:])
            if end >= 0 and (cut < 0 or start + off + end - len(m.stop) < cut):
                cut, keep, matched = start + off + end - len(m.stop), len(m.stop), m.stop
        if cut >= 0:
            self._truncate(cut + keep if self._include_stop else cut)
            self.stopped, self.matched = True, matched

    def _truncate(self, length: int) -> None:
        """Cut the text to ``length`` chars. Costs O(chars removed + one piece); happens once.

        The cut never reaches streamed text: that text was past every partial match when it
        was released, unless ``stream_delta(final=True)`` already released everything.
        """
        drop = self._len - length
        while drop:
            last = self._pieces[-1]
            if len(last) <= drop:
                self._pieces.pop()
                drop -= len(last)
            else:
                self._pieces[-1] = last[:len(last) - drop]
                drop = 0
        self._len = length
        self._joined = None
        if self._streamed >= length:  # only after a final stream_delta: nothing more to send
            self._streamed, self._sent_piece, self._sent_off = length, len(self._pieces), 0

    def stream_delta(self, final: bool = False) -> str:
        """New text safe to send: excludes a tail that could still grow into a stop string.

        O(chars released + pieces they span + number of stop strings).
        """
        end = self._len
        if self._matchers and not final and not self.stopped:
            end -= max(m.state for m in self._matchers)
        need = end - self._streamed
        pieces = self._pieces
        if need > 0 and not self._sent_off and self._sent_piece == len(pieces) - 1 and \
                len(pieces[-1]) == need:  # exactly the newest piece: the common case
            self._sent_piece += 1
            self._streamed = end
            return pieces[-1]
        out: list[str] = []
        while need > 0:
            piece = self._pieces[self._sent_piece]
            take = piece[self._sent_off:self._sent_off + need]
            out.append(take)
            need -= len(take)
            self._sent_off += len(take)
            if self._sent_off == len(piece):
                self._sent_piece, self._sent_off = self._sent_piece + 1, 0
        self._streamed = max(self._streamed, end)
        return "".join(out)
