"""The chat client of ``llm_routing.py``: pseudo-text, system prompts, and one request.

The text: :func:`words` (pseudo-words of an exact size) and :func:`system_prompts` (each
distinct from its first byte on, so that neither a prefix cache block nor a prefix-affinity
key is shared by two of them). The workloads made of them are ``llm_trace.py``'s.

The client: keep-alive HTTP/1.1 connections (:class:`HttpConn`, h11 over a Trio socket
stream: a few µs of parsing per event, so that on a small machine the client takes little of
the CPU the proxy and the engines need). :func:`chat` sends one request and measures it on
the client's clock (``time.monotonic_ns``) as vLLM's serving benchmark does: time to
the response head, TTFT (request sent -> the first SSE event whose delta carries content;
the role-only chunk some servers send first does not count), the gaps between content
events (events arriving in one read have a gap of 0), the end, the status, the engine that
answered (``x-backend-id``).
"""

from __future__ import annotations

import json
import random
import time
from array import array
from dataclasses import dataclass
from typing import Protocol

import h11
import trio

CHAT_PATH = b"/v1/chat/completions"
NET_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError)
"""What a request or a poll may meet on the wire; it ends that request (or poll), not the run."""


# --- the workload ------------------------------------------------------------------------------


def words(rng: random.Random, nbytes: int) -> str:
    """Lower-case pseudo-words, exactly ``nbytes`` bytes of ASCII."""
    out: list[str] = []
    size = 0
    while size < nbytes:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:nbytes]


def system_prompts(count: int, nbytes: int, seed: int) -> list[str]:
    """``count`` system prompts, distinct from their first byte on (their number leads)."""
    rng = random.Random(seed)
    prompts = []
    for k in range(count):
        head = f"System prompt {k:02d}. You are assistant number {k} of the fleet. "
        prompts.append(head + words(rng, nbytes - len(head)))
    return prompts


# --- HTTP/1.1 with h11 over Trio ---------------------------------------------------------------


class HttpConn:
    """One keep-alive HTTP/1.1 client connection, (re)opened when needed."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stream: trio.SocketStream | None = None
        self.h11 = h11.Connection(h11.CLIENT)

    async def send(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> None:
        if self.stream is None or self.h11.our_state is not h11.IDLE:
            await self.close()
            self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            self.h11 = h11.Connection(h11.CLIENT)
        head = [(b"host", b"bench"), *headers, (b"content-length", b"%d" % len(body))]
        out = self.h11.send(h11.Request(method=method, target=target, headers=head))
        out += self.h11.send(h11.Data(data=body)) if body else b""
        out += self.h11.send(h11.EndOfMessage())
        await self.stream.send_all(out)

    async def next_event(self) -> h11.Event:
        assert self.stream is not None
        while (event := self.h11.next_event()) is h11.NEED_DATA:
            self.h11.receive_data(await self.stream.receive_some(65536))
        # PAUSED comes only after a whole response, and we never read past one.
        assert isinstance(event, h11.Event), event
        return event

    def finish(self) -> None:
        """After the response's EndOfMessage: ready the connection for the next request."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.aclose()

    async def get(self, target: bytes) -> bytes:
        """A whole GET response body (any status)."""
        await self.send(b"GET", target, [])
        body = bytearray()
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.finish()
                return bytes(body)


# --- one request -------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request, as the client saw it; durations in seconds from the request being sent."""

    at: float
    """Seconds after the start of the run."""
    user: int
    prompt: int
    """Which system prompt."""
    turn: int = 0
    prompt_bytes: int = 0
    """Bytes of the request body."""
    max_tokens: int = 0
    status: int = 0
    """HTTP status; 0: none arrived."""
    engine: str = ""
    head_s: float | None = None
    """Request sent -> response head."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    result: str = "unfinished"
    """ok, http_NNN, short (fewer tokens than asked), error: ..., timeout, unfinished."""


class Sender(Protocol):
    """Who sends a request: a user id (the ``x-user`` header) and the connection to use."""

    uid: int
    conn: HttpConn | None


async def chat(
    user: Sender,
    outcome: Outcome,
    sent: list[dict[str, str]],
    gaps: array[int] | None,
) -> str | None:
    """Send one turn and read its stream; fills ``outcome``; returns the reply text if whole."""
    body = json.dumps(
        {"model": "bench", "stream": True, "max_tokens": outcome.max_tokens, "messages": sent},
        separators=(",", ":"),
    ).encode()
    outcome.prompt_bytes = len(body)
    headers = [
        (b"content-type", b"application/json"),
        (b"accept", b"text/event-stream"),
        (b"x-user", b"user-%d" % user.uid),
    ]
    assert user.conn is not None
    conn = user.conn
    start = time.monotonic_ns()
    await conn.send(b"POST", CHAT_PATH, headers, body)
    response = await conn.next_event()
    now = time.monotonic_ns()
    assert isinstance(response, h11.Response)
    outcome.status = response.status_code
    outcome.head_s = (now - start) / 1e9
    for name, value in response.headers:
        if name == b"x-backend-id":
            outcome.engine = value.decode()
    parts: list[str] = []
    buffer = b""
    last = 0
    done = False
    while True:
        event = await conn.next_event()
        now = time.monotonic_ns()
        if isinstance(event, h11.EndOfMessage):
            conn.finish()
            break
        if not isinstance(event, h11.Data) or outcome.status != 200:
            continue
        *events, buffer = (buffer + event.data).split(b"\n\n")
        for sse in events:
            if not sse.startswith(b"data: "):
                continue
            if sse == b"data: [DONE]":
                done = True
                continue
            content = json.loads(sse[6:])["choices"][0]["delta"].get("content")
            if not content:
                continue
            parts.append(content)
            if last:
                if gaps is not None:
                    gaps.append(now - last)
            else:
                outcome.ttft_s = (now - start) / 1e9
            last = now
    outcome.e2e_s = (time.monotonic_ns() - start) / 1e9
    outcome.tokens = len(parts)
    if outcome.status != 200:
        outcome.result = f"http_{outcome.status}"
        return None
    if not done or outcome.tokens != outcome.max_tokens:
        outcome.result = "short"
        return None
    outcome.result = "ok"
    return "".join(parts)
