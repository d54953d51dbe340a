"""The fake LLM backend's other wire formats: one generation told as named server-sent events.

The OpenAI Responses API (``openai_responses.py``) and the Anthropic Messages API
(``anthropic_messages.py``) stream as ``event: <name>`` + ``data: <json>`` pairs rather than
chat completions' bare ``data:`` lines, and answer non-streaming requests with their own JSON
object. Each is a :class:`Wire`: pure, it only says which events a generation makes; this
module sends them, paced by the same token clock, engine model and knobs as chat completions
(``app.py`` hands it what it needs as callables, so it never reaches into the app).

What it obeys, the same as chat completions: the stream head goes out at once, each token's
events when the clock has it out; die-after cuts the stream before token ``die_after`` (the app
then aborts it), or, non-streaming, sends the head and half the body. A wire that has an
:meth:`Wire.overloaded` event (Anthropic's ``overloaded_error``, the Responses ``error``
event) sends it instead when die-after is 0, and ends its stream cleanly, as those APIs report
an overloaded engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import attrs

from muxproxy.testing.fakellm.answer import Reply
from muxproxy.testing.fakellm.completions import body_message
from muxproxy.testing.fakellm.pacing import TokenClock
from muxproxy.testing.fakellm.responses import dumps

Event = tuple[str, dict[str, Any]]
"""An event's name and its ``data`` object."""


class Wire(Protocol):
    """The events and the whole object of one generation in one wire format."""

    def start(self) -> list[Event]:
        """Events before the first token."""
        ...

    def delta(self, text: str) -> list[Event]:
        """Events carrying one token's ``text``."""
        ...

    def end(self, text: str) -> list[Event]:
        """Events after the last token; ``text`` is the whole reply."""
        ...

    def whole(self, text: str) -> dict[str, Any]:
        """The non-streaming answer."""
        ...

    def overloaded(self) -> Event | None:
        """The error event sent instead of the first token when die-after is 0, if any."""
        ...


@attrs.frozen
class Generation:
    """What the app lends to one generation."""

    reply: Reply
    die_after: int | None
    send: Callable[[dict[str, Any]], Awaitable[bool]]
    """Sends one ASGI message; False once the client is gone."""
    generating: Callable[[int], AbstractAsyncContextManager[TokenClock]]
    """Holds the engine model for a generation of that many tokens."""
    stream_head: dict[str, Any]
    json_head: Callable[[int], dict[str, Any]]
    """The head of a whole JSON body of that length."""
    finishing: Callable[[bool], None]
    """Called once the last message is about to go (a disconnect no longer counts); True when
    it ends a complete stream."""


def sse(event: Event, more_body: bool = True) -> dict[str, Any]:
    """The ASGI body message of one named server-sent event."""
    name, data = event
    return body_message(b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n", more_body)


async def produce_stream(wire: Wire, gen: Generation, started: Callable[[], None]) -> bool:
    """Stream the generation; True when it must die (die-after). ``started`` is called as the
    head goes out."""
    reply, die_after = gen.reply, gen.die_after
    started()
    if not await gen.send(gen.stream_head):
        return False
    for event in wire.start():
        if not await gen.send(sse(event)):
            return False
    async with gen.generating(reply.count) as clock:
        overloaded = wire.overloaded() if die_after == 0 else None
        if overloaded is not None:
            await clock.wait_generated(0)
            gen.finishing(False)
            await gen.send(sse(overloaded, more_body=False))
            return False
        for i in range(reply.count):
            if die_after is not None and i >= die_after:
                gen.finishing(False)
                return True
            await clock.wait_generated(i + 1)
            for event in wire.delta(reply.token(i)):
                if not await gen.send(sse(event)):
                    return False
        if die_after is not None:
            gen.finishing(False)
            return True
        await clock.wait_generated(reply.count)
    *body, last = wire.end(reply.text)
    for event in body:
        if not await gen.send(sse(event)):
            return False
    gen.finishing(True)
    await gen.send(sse(last, more_body=False))
    return False


async def produce_whole(wire: Wire, gen: Generation) -> bool:
    """Send the whole answer once "generated"; True when it must die (die-after)."""
    generated = gen.reply.count if gen.die_after is None else gen.die_after
    async with gen.generating(generated) as clock:
        await clock.wait_generated(generated)
    payload = dumps(wire.whole(gen.reply.text))
    gen.finishing(False)
    if not await gen.send(gen.json_head(len(payload))):
        return False
    if gen.die_after is not None:
        return await gen.send(body_message(payload[: len(payload) // 2], more_body=True))
    await gen.send(body_message(payload, more_body=False))
    return False


def prompt_words(value: object) -> int:
    """A crude prompt size: whitespace-separated words of every string content or ``text``
    part in ``value`` (a string, or a list of messages / input items)."""
    if isinstance(value, str):
        return len(value.split())
    if not isinstance(value, list):
        return 0
    total = 0
    for item in value:
        if isinstance(item, dict):
            total += prompt_words(item.get("content", item.get("text")))
        elif isinstance(item, str):
            total += len(item.split())
    return total
