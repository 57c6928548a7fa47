"""`response_format: {"type": "json_object"}`: constrain sampling so that the output always parses as JSON.

`JsonPrefix` is a byte-level pushdown automaton that accepts exactly the prefixes of a JSON document whose
top-level value is an object (RFC 8259 grammar; runs of whitespace are bounded so that a model cannot pad
forever). `feed(data)` says whether the bytes keep the text a valid prefix; `complete` tells when the object
is closed; `completion()` is the shortest text that closes it (used to finish on time when `max_tokens` is
about to run out). `JsonConstraint` applies it to token ids through a table of each token's bytes.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

(START, VALUE, ARR_FIRST, OBJ_FIRST, OBJ_KEY, COLON, AFTER, STR, STR_ESC, STR_U, LIT, DONE,
 N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP) = range(20)
_NUMBER_END_OK = {N_ZERO, N_INT, N_FRAC, N_EXP}
_WS_STATES = {VALUE, ARR_FIRST, OBJ_FIRST, OBJ_KEY, COLON, AFTER}
_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
_CLOSER = {"{": ord("}"), "[": ord("]")}


class JsonPrefix:
    __slots__ = ("mode", "stack", "key", "aux", "lit", "ws", "max_ws")

    def __init__(self, max_ws: int = 16):
        self.mode, self.stack, self.key, self.aux, self.lit, self.ws = START, "", False, 0, b"", 0
        self.max_ws = max_ws

    def copy(self) -> "JsonPrefix":
        other = JsonPrefix.__new__(JsonPrefix)
        other.mode, other.stack, other.key, other.aux = self.mode, self.stack, self.key, self.aux
        other.lit, other.ws, other.max_ws = self.lit, self.ws, self.max_ws
        return other

    @property
    def complete(self) -> bool:
        return self.mode == DONE

    def feed(self, data: bytes) -> bool:
        """Consume `data`; False (and an undefined state) when the text stops being a valid prefix."""
        for b in data:
            if not self._step(b):
                return False
        return True

    def accepts(self, data: bytes) -> bool:
        """Whether `data` would keep the text a valid prefix (the state is not changed)."""
        return bool(data) and self.copy().feed(data)

    # ---- transitions ------------------------------------------------------------------------------------------
    def _close(self) -> None:
        self.stack = self.stack[:-1]
        self.mode = AFTER if self.stack else DONE

    def _begin_value(self, b: int) -> bool:
        if b == 0x7B:  # {
            self.stack += "{"
            self.mode = OBJ_FIRST
        elif b == 0x5B:  # [
            self.stack += "["
            self.mode = ARR_FIRST
        elif b == 0x22:  # "
            self.mode, self.key = STR, False
        elif b == 0x2D:  # -
            self.mode = N_MINUS
        elif b == 0x30:
            self.mode = N_ZERO
        elif b in _DIGITS:
            self.mode = N_INT
        elif b in _LITERALS:
            self.mode, self.lit = LIT, _LITERALS[b]
        else:
            return False
        return True

    def _step(self, b: int) -> bool:
        m = self.mode
        if m == STR:
            if b == 0x22:
                self.mode = COLON if self.key else AFTER
                return True
            if b == 0x5C:
                self.mode = STR_ESC
                return True
            return b >= 0x20
        if m == STR_ESC:
            if b in _ESCAPES:
                self.mode = STR
                return True
            if b == 0x75:  # u
                self.mode, self.aux = STR_U, 4
                return True
            return False
        if m == STR_U:
            if b not in _HEX:
                return False
            self.aux -= 1
            if self.aux == 0:
                self.mode = STR
            return True
        if m == LIT:
            if b != self.lit[0]:
                return False
            self.lit = self.lit[1:]
            if not self.lit:
                self.mode = AFTER
            return True
        if m >= N_MINUS:
            if self._number(b):
                return True
            if m not in _NUMBER_END_OK:
                return False
            self.mode = m = AFTER  # the number ended: this byte belongs to what follows
        if b in _WS:
            if m not in _WS_STATES or self.ws >= self.max_ws:
                return False
            self.ws += 1
            return True
        self.ws = 0
        if m == START:
            if b != 0x7B:
                return False
            self.stack, self.mode = "{", OBJ_FIRST
            return True
        if m == VALUE or m == ARR_FIRST:
            if m == ARR_FIRST and b == 0x5D:
                self._close()
                return True
            return self._begin_value(b)
        if m == OBJ_FIRST or m == OBJ_KEY:
            if b == 0x22:
                self.mode, self.key = STR, True
                return True
            if m == OBJ_FIRST and b == 0x7D:
                self._close()
                return True
            return False
        if m == COLON:
            if b == 0x3A:
                self.mode = VALUE
                return True
            return False
        if m == AFTER:
            top = self.stack[-1]
            if b == 0x2C:  # ,
                self.mode = OBJ_KEY if top == "{" else VALUE
                return True
            if b == _CLOSER[top]:
                self._close()
                return True
            return False
        return False  # DONE: nothing may follow

    def _number(self, b: int) -> bool:
        """A byte that continues the current number (updates the mode), else False."""
        m, digit = self.mode, b in _DIGITS
        if m == N_MINUS:
            if not digit:
                return False
            self.mode = N_ZERO if b == 0x30 else N_INT
        elif m in (N_ZERO, N_INT, N_FRAC):
            if digit and m != N_ZERO:
                return True
            if b == 0x2E and m != N_FRAC:
                self.mode = N_DOT
            elif b in (0x65, 0x45):
                self.mode = N_E
            else:
                return False
        elif m == N_DOT:
            if not digit:
                return False
            self.mode = N_FRAC
        elif m == N_E:
            if b in (0x2B, 0x2D):
                self.mode = N_ESIGN
            elif digit:
                self.mode = N_EXP
            else:
                return False
        elif m == N_ESIGN:
            if not digit:
                return False
            self.mode = N_EXP
        elif m == N_EXP:
            return digit
        return True

    # ---- closing ------------------------------------------------------------------------------------------------
    def _closing_byte(self) -> int:
        m = self.mode
        if m == START:
            return 0x7B
        if m in (STR, OBJ_KEY):
            return 0x22
        if m == STR_ESC:
            return ord("n")
        if m in (STR_U, VALUE, N_MINUS, N_DOT, N_E, N_ESIGN):
            return 0x30
        if m == LIT:
            return self.lit[0]
        if m == COLON:
            return 0x3A
        if m == ARR_FIRST:
            return 0x5D
        if m == OBJ_FIRST:
            return 0x7D
        return _CLOSER[self.stack[-1]]  # AFTER and numbers that may end

    def completion(self) -> str:
        """The shortest text that makes the document complete (empty when it already is)."""
        state, out = self.copy(), bytearray()
        while state.mode != DONE:
            b = state._closing_byte()
            if not state._step(b):  # cannot happen for a valid prefix; stop rather than loop
                break
            out.append(b)
        return out.decode("utf-8")


def first_byte_index(token_bytes: Sequence[Optional[bytes]]) -> torch.Tensor:
    """[vocab] long tensor: each token's first byte, 256 for tokens without bytes (special, empty)."""
    return torch.tensor([data[0] if data else 256 for data in token_bytes], dtype=torch.long)


class JsonConstraint:
    """A choice's JSON state over token ids; `token_bytes[id]` is None for tokens that never fit (special).
    `first_bytes` (from `first_byte_index`) lets `candidates()` rule out most invalid tokens at once."""

    def __init__(self, token_bytes: Sequence[Optional[bytes]], encode, first_bytes: Optional[torch.Tensor] = None,
                 max_ws: int = 16):
        self.token_bytes, self.encode = token_bytes, encode
        self.first_bytes = first_bytes if first_bytes is not None else first_byte_index(token_bytes)
        self.state = JsonPrefix(max_ws)

    def candidates(self) -> torch.Tensor:
        """[vocab] bool: tokens whose first byte may come next (a superset of the valid tokens)."""
        allowed = torch.zeros(257, dtype=torch.bool)
        for b in range(256):
            if self.state.copy()._step(b):
                allowed[b] = True
        return allowed[self.first_bytes]

    @property
    def complete(self) -> bool:
        return self.state.complete

    def allows(self, token_id: int, budget: Optional[int] = None) -> bool:
        """Whether the token keeps the text a valid prefix and, with a `budget`, whether the document can
        still be closed within `budget` more tokens after it."""
        data = self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else None
        if not data:
            return False
        after = self.state.copy()
        if not after.feed(data):
            return False
        if budget is not None:
            text = after.completion()
            return not text or len(self.encode(text)) <= budget
        return True

    def advance(self, token_id: int) -> None:
        data = self.token_bytes[token_id]
        if data is None or not self.state.feed(data):
            raise ValueError(f"token {token_id} does not continue the JSON text")

    def closing_tokens(self) -> List[int]:
        """Token ids that write the shortest completion of the document."""
        text = self.state.completion()
        return list(self.encode(text)) if text else []
