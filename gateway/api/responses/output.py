"""A response's output items built from the generated text, with the typed stream events that tell them.

`OutputBuilder` takes what the chat path's tool-call parser (`gateway.structured.toolparse.ToolCallParser`) makes of the
text (content deltas and tool-call chunks) and keeps the Response object's `output` up to date: an assistant `message`
item (one `output_text` part) for content, a `function_call` item per call (its `call_id` is the parser's `call_...`
id, its arguments as they stream). Each change is also an event of OpenAI's stream, numbered by `sequence_number`:
`response.created` and `response.in_progress` first; for a message `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., then `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`; for a call `response.output_item.added`,
`response.function_call_arguments.delta`..., `response.function_call_arguments.done`, `response.output_item.done`;
last `response.completed` (or `response.incomplete` when `max_output_tokens` cut it, with `incomplete_details`).
A failure is an `error` event, then `response.failed` (its `error`: code `server_error`, or `rate_limit_exceeded`).
Items follow each other (text after a call opens a new message), so a non-streamed response built by feeding the
whole text at once has the same output as the streamed one.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from gateway.api.responses.schemas import (
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    Response,
    ResponseError,
    ResponseUsage,
)
from gateway.errors import APIError
from gateway.schemas import ToolCallChunk
from gateway.structured.toolparse import Parsed

Event = Tuple[str, str]  # (type, the event as JSON)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self, response: Response):
        self.response = response
        self.events: List[Event] = []  # made since the last `take`
        self.sequence = 0
        self.message: Optional[OutputMessage] = None  # the open message item
        self.call: Optional[OutputFunctionCall] = None  # the open function call item
        self.calls: Dict[int, OutputFunctionCall] = {}  # the parser's call index -> its item

    # ---- events -------------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> None:
        body = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        self.events.append((kind, _json(body)))

    def _response_event(self, kind: str) -> None:
        self._event(kind, response=self.response.model_dump(mode="json"))

    def take(self) -> List[Event]:
        """The events made since the last call."""
        events, self.events = self.events, []
        return events

    def start(self) -> None:
        self._response_event("response.created")
        self._response_event("response.in_progress")

    # ---- output -------------------------------------------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def feed(self, parsed: Parsed) -> None:
        """One parser result: its content, then its calls' chunks."""
        if parsed.content:
            self.text(parsed.content)
        for chunk in parsed.chunks:
            self.call_chunk(chunk)

    def text(self, delta: str) -> None:
        if self.message is None:
            self._close_call("completed")
            self.message = OutputMessage(id=new_id("msg"), status="in_progress")
            self.response.output.append(self.message)
            self._event("response.output_item.added", output_index=self._index,
                        item=self.message.model_dump(mode="json"))
            self.message.content.append(OutputText(text=""))
            self._event("response.content_part.added", item_id=self.message.id, output_index=self._index,
                        content_index=0, part=self.message.content[0].model_dump(mode="json"))
        self.message.content[0].text += delta
        self._event("response.output_text.delta", item_id=self.message.id, output_index=self._index,
                    content_index=0, delta=delta, logprobs=[])

    def call_chunk(self, chunk: ToolCallChunk) -> None:
        function = chunk.function
        if chunk.id is not None:  # a call's first chunk: its id and name
            self._close_message("completed")
            self._close_call("completed")
            name = (function.name or "") if function is not None else ""
            self.call = OutputFunctionCall(id=new_id("fc"), call_id=chunk.id, name=name, arguments="",
                                           status="in_progress")
            self.calls[chunk.index] = self.call
            self.response.output.append(self.call)
            self._event("response.output_item.added", output_index=self._index,
                        item=self.call.model_dump(mode="json"))
        call = self.calls.get(chunk.index)
        if call is not None and function is not None and function.arguments:
            call.arguments += function.arguments
            self._event("response.function_call_arguments.delta", item_id=call.id,
                        output_index=self.response.output.index(call), delta=function.arguments)

    def _close_message(self, status: str) -> None:
        message, self.message = self.message, None
        if message is None:
            return
        index, part = self.response.output.index(message), message.content[0]
        message.status = status  # type: ignore[assignment]
        self._event("response.output_text.done", item_id=message.id, output_index=index, content_index=0,
                    text=part.text, logprobs=[])
        self._event("response.content_part.done", item_id=message.id, output_index=index, content_index=0,
                    part=part.model_dump(mode="json"))
        self._event("response.output_item.done", output_index=index, item=message.model_dump(mode="json"))

    def _close_call(self, status: str) -> None:
        call, self.call = self.call, None
        if call is None:
            return
        index = self.response.output.index(call)
        call.status = status  # type: ignore[assignment]
        self._event("response.function_call_arguments.done", item_id=call.id, output_index=index, name=call.name,
                    arguments=call.arguments)
        self._event("response.output_item.done", output_index=index, item=call.model_dump(mode="json"))

    # ---- the end ------------------------------------------------------------------------------------------------
    def finish(self, cut: bool, usage: ResponseUsage) -> None:
        """Close the open items and end the response: `cut` by max_output_tokens (status incomplete) or not."""
        status = "incomplete" if cut else "completed"
        self._close_message(status)
        self._close_call(status)
        response = self.response
        response.status = status  # type: ignore[assignment]
        response.usage = usage
        if cut:
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        else:
            response.completed_at = int(time.time())
        self._response_event("response.incomplete" if cut else "response.completed")

    def fail(self, error: APIError) -> None:
        """The generation failed: an `error` event, then `response.failed` (the last event)."""
        self._event("error", code=error.code or error.type, message=error.message, param=error.param)
        self.response.status = "failed"
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        self.response.error = ResponseError(code=code, message=error.message)
        self._response_event("response.failed")


def _json(body: Dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
