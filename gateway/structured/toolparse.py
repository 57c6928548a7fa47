"""Tool calls read back out of generated text (the Hermes format of `gateway.structured.tools`), whole or streamed.

`ToolCallParser` takes a choice's text deltas as they come and returns what can be sent: content (the text outside
`<tool_call>` blocks, a suffix that could begin a block held back, whitespace around blocks dropped; a block ends at
the first closing tag outside a JSON string) and each call as
soon as its block is closed. A block whose body is not `{"name": <one of the tools>, "arguments": {...}}` stays
content, as vLLM's Hermes parser does. With `max_calls` (`parallel_tool_calls: false`: 1) later blocks are dropped.
`finish()` reads a block the model ended without its closing tag. A whole response is the same parser fed the whole
text (`parse_all`), so the streamed and the non-streamed answers agree by construction.

Calls stream as OpenAI streams them (`Parsed.chunks`): per call, a chunk with `index`, `id` (`call_...`), `type` and
the function's name (empty arguments), then its arguments. A forced call (`stream_arguments`: the grammar guarantees
a valid call) streams its arguments as they are generated, fragment by fragment (a `}` that may be the block's own
closing brace waits for what follows it), and its `arguments` are exactly the generated text; a call the model chose
(`auto`) is sent once its block has closed and parsed (`call_chunks`: arguments in one piece, re-encoded
by `json.dumps`), so that a call is never streamed and then retracted.

A forced call cut short (`max_tokens`) is still a call, as OpenAI returns one (with `finish_reason: "length"`): its
arguments as far as they got (possibly empty or not yet valid JSON), never the gateway's markup as content. Its name
is the one its header names; cut inside the header, the one forced tool its text can still lead to (the grammar's
exact `call_header`), or "" when several can (only `required` with tools sharing a name prefix, cut within a few
tokens). Streamed, `finish()` sends what was held back of it; whole, `parse_all` returns the same call.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable, Collection, List, Optional, Sequence, Tuple

from gateway.schemas import FunctionCall, FunctionCallChunk, ToolCall, ToolCallChunk, ToolDefinition
from gateway.structured.tools import CALL_CLOSE, CALL_OPEN, call_header


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Parsed:
    content: str = ""
    calls: List[ToolCall] = field(default_factory=list)  # calls whose block closed (or, forced, was cut short)
    chunks: List[ToolCallChunk] = field(default_factory=list)  # what to stream of the calls


@dataclass
class _OpenCall:
    """A forced call being streamed: its arguments start at `start` in the block; `sent` is how far they went."""
    id: str
    name: str
    index: int
    start: int
    sent: int


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _close_index(body: str) -> int:
    """Where the block's closing tag starts in `body` (-1: not yet), skipping JSON strings (an argument may contain
    the tag's text)."""
    in_string = escaped = False
    for i, ch in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "<" and body.startswith(CALL_CLOSE, i):
            return i
    return -1


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallParser:
    def __init__(self, names: Collection[str], max_calls: Optional[int] = None, stream_arguments: bool = False):
        self.names, self.max_calls, self.stream_arguments = set(names), max_calls, stream_arguments
        self.open: Optional[_OpenCall] = None
        self.buffer = ""  # text not yet consumed
        self.inside = False  # the buffer starts inside a block (after its opening tag)
        self.after_block = False  # whitespace right after a block is dropped
        self.calls: List[ToolCall] = []
        self.started = False  # content was sent (whitespace inside content is kept from then on)
        self.cut = False  # the last call is a forced call cut short

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            if self.inside:
                end = _close_index(self.buffer)
                if self.stream_arguments:
                    self._stream(out, end)
                if end < 0:
                    return out
                self._block(self.buffer[:end], out, closed=True)
                self.buffer, self.inside, self.after_block = self.buffer[end + len(CALL_CLOSE):], False, True
                continue
            if self.after_block:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return out
                self.after_block = False
            start = self.buffer.find(CALL_OPEN)
            if start >= 0:
                self._content(self.buffer[:start].rstrip(), out)
                self.buffer, self.inside = self.buffer[start + len(CALL_OPEN):], True
                continue
            keep = _held(self.buffer, CALL_OPEN)
            ready = self.buffer[:len(self.buffer) - keep]
            sendable = ready.rstrip()  # trailing whitespace waits: it is dropped if a block follows
            self._content(sendable, out)
            self.buffer = self.buffer[len(sendable):]
            return out

    def whole(self, text: str) -> Tuple[Optional[str], List[ToolCall]]:
        """A whole choice's (content or None, tool calls): `text` fed at once, then finished."""
        first, last = self.feed(text), self.finish()
        content = first.content + last.content
        return (content or None), first.calls + last.calls

    def finish(self) -> Parsed:
        """What is left at the end of the choice: an unclosed block (a call if its body parses), held-back text."""
        out = Parsed()
        rest = self.buffer.lstrip()
        if self.inside and self.stream_arguments:
            self._cut(self.buffer, out)
        elif self.inside:
            self._block(self.buffer, out, closed=False)
        elif self.stream_arguments and rest and CALL_OPEN.startswith(rest):  # cut inside a forced call's opening tag
            self._cut("", out)
        elif not self.after_block:
            self._content(self.buffer.rstrip(), out)
        self.buffer, self.inside = "", False
        return out

    def _content(self, text: str, out: Parsed) -> None:
        if not self.started:
            text = text.lstrip()
        if text:
            out.content += text
            self.started = True

    def _full(self) -> bool:
        return self.max_calls is not None and len(self.calls) >= self.max_calls

    def _open(self, out: Parsed, name: str, start: int) -> _OpenCall:
        self.open = _OpenCall(new_call_id(), name, len(self.calls), start, start)
        out.chunks.append(ToolCallChunk(index=self.open.index, id=self.open.id, type="function",
                                        function=FunctionCallChunk(name=name, arguments="")))
        return self.open

    def _stream(self, out: Parsed, end: int, final: bool = False) -> None:
        """A forced call's header once its name is out, then its arguments as they grow (all but a last `}` that may
        be the block's own closing brace). `final`: the text ends here (no byte of the arguments needs to follow)."""
        if self.open is None:
            match = _HEADER.match(self.buffer)
            if match is None or (match.end() == len(self.buffer) and not final) or self._full():
                return  # (wait for the arguments' first byte)
            name = json.loads(f'"{match.group(1)}"')
            if name not in self.names:
                return
            self._open(out, name, match.end())
        assert self.open is not None
        limit = self.buffer.rfind("}", self.open.sent, end if end >= 0 else len(self.buffer))
        if end < 0:  # still open: a last `}` followed by nothing but the start of the closing tag may be the block's
            tail = self.buffer[limit + 1:].lstrip() if limit >= 0 else "x"  # own brace: held back, the rest is sent
            if not CALL_CLOSE.startswith(tail):
                limit = len(self.buffer)
        if limit > self.open.sent:
            piece, self.open.sent = self.buffer[self.open.sent:limit], limit
            out.chunks.append(ToolCallChunk(index=self.open.index, function=FunctionCallChunk(arguments=piece)))

    def _cut(self, body: str, out: Parsed) -> None:
        """A forced call whose block `body` (text after the opening tag) ends here, unclosed: a call as far as it
        got. Its arguments are all that follows the header, less the block's own closing brace (and a start of the
        closing tag) when the body is whole."""
        if self._full():
            return
        self.buffer = body
        if self.open is None and body:
            self._stream(out, -1, final=True)
        opened = self.open or self._open(out, self._cut_name(body), len(body))
        self.open, stop = None, len(body)
        brace = body.rfind("}")
        if brace >= 0 and CALL_CLOSE.startswith(body[brace + 1:].strip()):
            try:
                json.loads(body[:brace + 1])
                stop = brace  # the whole body: the last brace is the block's
            except ValueError:
                pass
        if stop > opened.sent:
            out.chunks.append(ToolCallChunk(index=opened.index,
                                            function=FunctionCallChunk(arguments=body[opened.sent:stop])))
        call = ToolCall(id=opened.id, function=FunctionCall(name=opened.name,
                                                            arguments=body[opened.start:max(stop, opened.start)]))
        self.calls.append(call)
        out.calls.append(call)
        self.cut = True

    def _cut_name(self, body: str) -> str:
        """The name of a forced call cut inside its header: the one tool its text can still lead to, else ""."""
        text = body.lstrip()
        fits = [name for name in self.names if call_header(name).startswith(text)]
        return fits[0] if len(fits) == 1 else ""

    def _block(self, body: str, out: Parsed, closed: bool) -> None:
        opened, self.open = self.open, None
        if opened is not None:  # streamed: its arguments are the text that was streamed
            if self._call(body) is not None:
                streamed = ToolCall(id=opened.id, function=FunctionCall(name=opened.name,
                                                                        arguments=body[opened.start:opened.sent]))
                self.calls.append(streamed)
                out.calls.append(streamed)
            return
        call = self._call(body)
        if call is None:
            self._content(CALL_OPEN + body + (CALL_CLOSE if closed else ""), out)
        elif self.max_calls is None or len(self.calls) < self.max_calls:
            out.chunks.extend(call_chunks(len(self.calls), call))
            self.calls.append(call)
            out.calls.append(call)

    def _call(self, body: str) -> Optional[ToolCall]:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        return ToolCall(id=new_call_id(), function=FunctionCall(name=value["name"],
                                                                arguments=json.dumps(arguments, ensure_ascii=False)))


def parse_all(text: str, names: Collection[str], max_calls: Optional[int] = None,
              stream_arguments: bool = False) -> Tuple[Optional[str], List[ToolCall]]:
    """A whole choice's (content or None, tool calls), as the same parser streams them."""
    return ToolCallParser(names, max_calls, stream_arguments).whole(text)


def call_chunks(index: int, call: ToolCall) -> List[ToolCallChunk]:
    """A call's streamed pieces: its header (id, type, name), then its arguments."""
    return [ToolCallChunk(index=index, id=call.id, type="function",
                          function=FunctionCallChunk(name=call.function.name, arguments="")),
            ToolCallChunk(index=index, function=FunctionCallChunk(arguments=call.function.arguments))]


def parser_maker(tools: Optional[Sequence[ToolDefinition]], tool_choice: str, parallel_tool_calls: Optional[bool]
                 ) -> Optional[Callable[[], ToolCallParser]]:
    """A maker of one choice's parser for a request's tools (None, or `tool_choice` 'none': the output is not parsed)
    and effective `tool_choice` (`gateway.structured.tools.check_tools`). A forced call (`required`, a named function)
    streams its arguments as generated (the grammar guarantees the call); a named function is the one name a call may
    have; `parallel_tool_calls: false` allows one call."""
    if not tools:
        return None
    forced = tool_choice not in ("none", "auto")
    names = [tool_choice] if forced and tool_choice != "required" else [t.function.name for t in tools]
    max_calls = 1 if parallel_tool_calls is False else None
    return functools.partial(ToolCallParser, names, max_calls, forced)


def finish_reason(reason: Optional[str], parser: Optional[ToolCallParser]) -> Optional[str]:
    """OpenAI's `tool_calls` when the model stopped after calling tools (`parser`: the choice's, None without tools).
    A cut-off answer stays `length`, and `stop` where a stop string or token cut a forced call short."""
    done = parser is not None and parser.calls and not parser.cut
    return "tool_calls" if done and reason == "stop" else reason
