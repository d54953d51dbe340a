"""Continuation of an Anthropic Messages answer: the next server finishes it by an assistant
prefill, and its stream is spliced into the one the client has.

What it obeys, and why (``continuation.py`` does the same for Chat Completions):

- Only a streamed Messages request (``/v1/messages``, a JSON body with a ``messages`` array and
  ``"stream": true``) kept whole is followed, on a route with ``continue_on_failure``; one whose
  last message is an assistant message with content blocks (not a string) is not.
- The answer so far (``MessagesSoFar``) is read from the events relayed: the text of the
  ``text_delta``\\s of the text blocks, which block is open, the blocks started, the content
  events (one token each, as the meter counts them). An answer with another kind of block (a
  tool call, thinking: their deltas cannot be prefilled as text) is not continued, nor is one
  that finished (``message_delta`` with a ``stop_reason``) — cut before its ``message_stop``
  with no partial event pending, that one is ended by the proxy, as is one that reached its
  ``max_tokens`` (``ending``).
- The continuation request (Messages' prefill, which Anthropic's API, vLLM and SGLang continue
  without a flag): the original with the text so far as a final ``assistant`` message (added
  to the original's own prefill, when it ended with one), and ``max_tokens`` less the tokens
  relayed. Anthropic's own API refuses a prefill that ends in white space (a 400): such a
  continuation fails, and the stream ends truncated as it would without one.
- The splice (``MessagesSplicer``): the client sees one message. The new stream's
  ``message_start`` is dropped (one ``message_start``, the original message id and model); a
  text block open when the backend died goes on: the new stream's first text block is merged
  into it (its ``content_block_start`` dropped, its events given the open block's index);
  every other block's ``index`` continues after the blocks already started. The new
  ``message_delta``'s ``usage.output_tokens`` counts its own tokens: the tokens relayed before
  are added, so the total is the whole answer's.

Pure: no clock, no I/O; one ``json.loads`` per event, on such routes only.
"""

from __future__ import annotations

import json
from typing import Any

from muxproxy.core.apis.paths import Api, api_for
from muxproxy.core.apis.streaming import split_event
from muxproxy.core.streams.continuation import MAX_TEXT, EventSplitter


def wants_prefill(target: bytes, document: object) -> bool:
    """Whether a request for ``target`` with JSON body ``document`` may be continued so."""
    if api_for(target.decode("latin-1")) is not Api.MESSAGES or not isinstance(document, dict):
        return False
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages or document.get("stream") is not True:
        return False
    last = messages[-1]
    return not (
        isinstance(last, dict)
        and last.get("role") == "assistant"
        and not isinstance(last.get("content"), str)
    )


def _event(name: str, data: dict[str, Any]) -> bytes:
    encoded = json.dumps(data, separators=(",", ":")).encode()
    return b"event: " + name.encode() + b"\ndata: " + encoded + b"\n\n"


def _payload(event: bytes) -> dict[str, Any] | None:
    """The event's data as a JSON object, None for one without data; raises ValueError for
    data that is not a JSON object."""
    parts = split_event(event)
    if parts is None:
        return None
    value = json.loads(parts[1])
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


class MessagesSoFar:
    """What the client has of a Messages answer, read from the events relayed to it."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.text: list[str] = []
        self.size = 0
        self.content_events = 0
        self.started = False
        """``message_start`` was relayed."""
        self.blocks = 0
        """Content blocks started (the next one's index)."""
        self.open_block: int | None = None
        """The index of the text block started and not stopped, if any."""
        self.finished = False
        """A ``message_delta`` with a ``stop_reason``: no token is missing."""
        self.done = False
        """``message_stop`` was relayed."""
        self.broken = False
        self._events = EventSplitter()

    @property
    def continuable(self) -> bool:
        return self.started and not self.finished and not self.broken

    @property
    def exhausted(self) -> bool:
        """Only the end was lost: it finished, or relayed as many tokens as ``max_tokens``."""
        if self._events.pending or self.broken or not self.started:
            return False
        limit = self.document.get("max_tokens")
        return self.finished or (isinstance(limit, int) and self.content_events >= limit)

    def ending(self) -> bytes:
        """The events that end an ``exhausted`` answer, as the engine would have."""
        if self.done:
            return b""
        out = []
        if not self.finished:
            if self.open_block is not None:
                stop = {"type": "content_block_stop", "index": self.open_block}
                out.append(_event("content_block_stop", stop))
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                "usage": {"output_tokens": self.content_events},
            }
            out.append(_event("message_delta", delta))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def feed(self, data: bytes) -> None:
        if self.broken or self.done:
            return
        for event in self._events.split(data):
            try:
                obj = _payload(event)
            except ValueError:
                self.broken = True
                return
            if obj is not None:
                self._follow(obj)
            if self.broken or self.done:
                return

    def _follow(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "message_start":
            self.started = True
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if not isinstance(block, dict) or block.get("type") != "text" or block.get("text"):
                self.broken = True  # a tool call or thinking: not text to prefill
                return
            self.open_block = self.blocks
            self.blocks += 1
        elif kind == "content_block_stop":
            self.open_block = None
        elif kind == "content_block_delta":
            delta = obj.get("delta")
            if not isinstance(delta, dict) or delta.get("type") != "text_delta":
                self.broken = True
                return
            text = delta.get("text")
            if not isinstance(text, str):
                self.broken = True
                return
            self.text.append(text)
            self.size += len(text)
            self.content_events += 1
            self.broken = self.size > MAX_TEXT
        elif kind == "message_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason") is not None:
                self.finished = True
        elif kind == "message_stop":
            self.finished = self.done = True

    def continuation_body(self) -> bytes:
        """The request that continues the answer (see the module)."""
        document = dict(self.document)
        messages = list(document["messages"])
        text = "".join(self.text)
        last = messages[-1]
        if isinstance(last, dict) and last.get("role") == "assistant":
            messages[-1] = {**last, "content": last["content"] + text}
        else:
            messages.append({"role": "assistant", "content": text})
        document["messages"] = messages
        limit = document.get("max_tokens")
        if isinstance(limit, int) and not isinstance(limit, bool):
            document["max_tokens"] = max(1, limit - self.content_events)
        return json.dumps(document, separators=(",", ":")).encode()

    def splicer(self) -> MessagesSplicer:
        return MessagesSplicer(self)


class MessagesSplicer:
    """Rewrites a continuation's events into the original message (see the module)."""

    def __init__(self, answer: MessagesSoFar) -> None:
        self.answer = answer
        self.merged: int | None = answer.open_block
        """The open block the new stream's first text block goes on in, until it started."""
        self.first_block: int | None = None
        """The new stream's index of the block merged into ``merged``."""
        self.offset = answer.blocks
        self.relayed = answer.content_events
        """The tokens relayed before this continuation (the answer goes on counting)."""
        self._events = EventSplitter()

    def feed(self, data: bytes) -> bytes:
        out = []
        for event in self._events.split(data):
            spliced = self._splice(event)
            if spliced is not None:
                out.append(spliced)
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._events.pending = self._events.pending, b""
        return rest

    def _splice(self, event: bytes) -> bytes | None:
        try:
            obj = _payload(event)
        except ValueError:
            return event + b"\n\n"
        kind = obj.get("type") if obj is not None else None
        if obj is None or not isinstance(kind, str):
            return event + b"\n\n"
        if kind == "message_start":
            return None  # the client has the original's
        if kind == "message_delta":
            usage = obj.get("usage")
            count = usage.get("output_tokens") if isinstance(usage, dict) else None
            if isinstance(count, int) and isinstance(usage, dict):
                usage["output_tokens"] = count + self.relayed
            return _event(kind, obj)
        index = obj.get("index")
        if not kind.startswith("content_block_") or not isinstance(index, int):
            return event + b"\n\n"
        block = obj.get("content_block")
        text_block = isinstance(block, dict) and block.get("type") == "text"
        if kind == "content_block_start" and self.merged is not None and self.first_block is None:
            if not text_block:
                self.merged = None  # not text: a block of its own after those started
                obj["index"] = index + self.offset
                return _event(kind, obj)
            self.first_block = index
            return None  # the open block goes on
        if index == self.first_block and self.merged is not None:
            obj["index"] = self.merged
        else:
            obj["index"] = index + self.offset - (1 if self.first_block is not None else 0)
        return _event(kind, obj)
