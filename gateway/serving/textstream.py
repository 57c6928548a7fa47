"""Turning generated token ids into streamed text: incremental decoding and stop strings with hold-back.

`StopMatcher` finds the first occurrence of any stop string and, while streaming, how much of the text is
safe to send: a suffix that could still grow into a stop string is held back, so a stop string never leaks,
not even in part. `TextStream` turns a choice's ids into text incrementally: with a `tokenizers` `DecodeStream`
(`Tokens.decode_stream`), each token costs the same however long the text already is (it buffers a character's
bytes until the character is complete); without one, it decodes the whole id list after each token and waits
while the text ends with U+FFFD (an incomplete multi-byte character). Either way a delta never splits a
character. Both are pure (no model, no network) and unit-tested.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

REPLACEMENT = "\ufffd"


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = sorted({s for s in stops if s}, key=len, reverse=True)

    def find(self, text: str, start: int = 0) -> Optional[int]:
        """Index of the earliest stop string occurrence in `text` beginning at or after `start`, else None."""
        best: Optional[int] = None
        for stop in self.stops:
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best):
                best = index
        return best

    def safe_length(self, text: str, start: int = 0) -> int:
        """Length of the prefix of `text` that cannot be the beginning of a stop string: the longest suffix
        (starting at or after `start`) that is a proper prefix of some stop string is held back."""
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text) - start), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return len(text) - held


class TextStream:
    """One choice's text: feed token ids, get the text deltas that are safe to send."""

    def __init__(self, decode: Callable[[List[int]], str], stops: Sequence[str] = (),
                 new_step: Optional[Callable[[], Callable[[int], Optional[str]]]] = None):
        """`decode`: ids -> text (the whole list); `new_step`: makes an incremental decoder (token id -> the text it
        completes, None while a character is incomplete), used instead of `decode` when given."""
        self._decode, self._new_step = decode, new_step
        self._step = new_step() if new_step is not None else None
        self.matcher = StopMatcher(stops)
        self.ids: List[int] = []
        self.text = ""  # decoded generated text so far (without the prefix)
        self.sent = 0  # characters of self.text already emitted
        self.stopped = False

    def add(self, token_id: int) -> Tuple[str, bool]:
        """Append a token; returns (delta to send, whether a stop string matched). After a match the text
        ends right before the stop string."""
        if self._new_step is not None and self._step is None:  # a copy's decoder, brought to where it stands
            self._step = self._new_step()
            for held in self.ids:
                self._step(held)
        self.ids.append(token_id)
        if self._step is not None:
            chunk = self._step(token_id)
            if not chunk:
                return "", False
            self.text += chunk
        else:
            self.text = self._decode(self.ids)
            if self.text.endswith(REPLACEMENT):
                return "", False
        index = self.matcher.find(self.text, self.sent)
        if index is not None:
            delta = self.text[self.sent:index]
            self.text = self.text[:index]
            self.sent = index
            self.stopped = True
            return delta, True
        safe = self.matcher.safe_length(self.text, self.sent)
        if safe > self.sent:
            delta, self.sent = self.text[self.sent:safe], safe
            return delta, False
        return "", False

    def __copy__(self) -> "TextStream":
        """An independent copy (a snapshot to go back to): its own ids and, where it decodes incrementally, its own
        decoder, made (by replaying the ids) only if the copy is used: snapshots taken every step and never gone
        back to cost a list copy each."""
        clone = object.__new__(TextStream)
        clone.__dict__.update(self.__dict__)
        clone.ids = list(self.ids)
        if self._new_step is not None:
            clone._step = None
        return clone

    def flush(self) -> str:
        """The text held back so far (at the end of a choice that did not hit a stop string); with an incremental
        decoder, also the bytes of a last, incomplete character, as the whole list's decoding gives them (U+FFFD)."""
        if self._new_step is not None and not self.stopped:
            whole = self._decode(self.ids)  # once per choice
            if len(whole) > len(self.text) and whole.startswith(self.text):
                self.text = whole
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
