"""A fake OpenAI-compatible LLM backend, for muxproxy's tests, ``muxproxy demo`` and benchmarks.

What it is: a plain ASGI 3 application (:attr:`FakeLLM.app`, no framework) served by
Hypercorn's Trio worker (:func:`serve_fakellm`). On one plain-TCP port it speaks HTTP/1.1
and h2c with prior knowledge (Hypercorn detects the HTTP/2 preface itself).

What it obeys:

* The OpenAI chat-completions wire format, closely enough for the ``openai`` Python SDK:
  ``POST /v1/chat/completions`` (``stream`` true: ``text/event-stream`` of
  ``chat.completion.chunk`` objects, one ASGI body message per event, closed by
  ``data: [DONE]``; ``stream`` false: one ``chat.completion`` object with ``usage``),
  ``GET /v1/models`` (a list holding the one model ``fake-llm``) and ``GET /health``
  (``200 ok``). Other paths answer 404, a wrong method 405 (with ``allow``).
* The ASGI 3 HTTP spec: the request body is always read to its end before answering, and
  ``http.disconnect`` is watched for while a completion is being generated, so a client
  that goes away is noticed at once, not at the next token write.

Every response the app makes carries ``x-backend-id: <id>``, and ``x-model-version: <v>``
when the backend is given a model version (``--model-version``: a gray release moves traffic
from one version to the next, and a client can tell which one answered). Reply text is
``tok0 tok1 ... tok<n-1> `` (see :func:`reply_text`).

Knobs: each has a default on :class:`FakeLLM` (constructor / CLI option, and the instance
is mutable, so a test may change one between requests) and a per-request header override:

=======================  =============================  ====================================
header                   attribute / CLI option         meaning
=======================  =============================  ====================================
``x-fake-tokens``        ``tokens`` / ``--tokens``      tokens per reply (16); without the
                                                        header the request's ``max_tokens``
                                                        (or ``max_completion_tokens``) is
                                                        used if given
``x-fake-delay``         ``delay`` / ``--delay``        seconds between tokens (0.02)
``x-fake-first-delay``   ``first_delay`` /              seconds before the first token (0)
                         ``--first-delay``
``x-fake-die-after``     ``die_after`` /                after N token events, abort: HTTP/1.1
                         ``--die-after``                closes the connection (no last
                                                        chunk), HTTP/2 resets the stream
                                                        (RST_STREAM INTERNAL_ERROR). N ==
                                                        tokens: dies before the finish chunk;
                                                        N > tokens: no abort; ``none`` (or
                                                        ``-1``) disables a default
``x-fake-status``        ``status`` / ``--status``      answer every request with status S
                                                        and a small OpenAI-style JSON error
                                                        body (200: normal behaviour)
``x-fake-role-chunk``    ``role_chunk`` /               ``1``: a stream starts at once, before
                         ``--role-chunk``               ``first_delay``, with a role-only
                                                        chunk (``"delta": {"role":
                                                        "assistant", "content": ""}``), as
                                                        vLLM and OpenAI send; the first token
                                                        chunk then carries no role (False)
``x-fake-echo-headers``  (per request only)             ``1``: add ``request_headers``
                                                        (lower-case name -> value, repeats
                                                        joined ", ") to the JSON body / the
                                                        first SSE chunk
``x-fake-sink``          (per request only)             ``1`` on a POST to any path: answer
                                                        ``{"received_bytes": n,
                                                        "sha256": hex}``
=======================  =============================  ====================================

Precedence, after the request body is read: a malformed knob header answers 400, then a
status other than 200 answers that status, then ``x-fake-sink``, then routing (404/405).

A non-streaming completion waits as long as streaming it would have taken
(``first_delay + (n - 1) * delay``); with die-after it sends the head (with the full
``content-length``) and half the body, then aborts. Malformed knob headers or JSON answer 400.

Observability: :class:`FakeLLM` counts ``requests``, ``streams_started``,
``streams_completed``, ``aborts`` (die-after fired) and ``disconnects`` (completions,
streamed or not, whose client went away before the end), keeps ``last_request_headers``,
and offers :meth:`FakeLLM.wait_disconnect` / :meth:`FakeLLM.wait_until` to await them.

Hypercorn quirks this module works around:

* An ASGI app that raises after ``http.response.start`` makes Hypercorn close an HTTP/1.1
  connection without the terminating chunk, but on HTTP/2 it leaves the stream open for
  ever (neither END_STREAM nor RST_STREAM). Die-after therefore resets the h2 stream
  itself, reaching Hypercorn's H2Protocol through the ``send`` callable (best effort; on
  any other server the exception alone is the abort).
* A lifespan-less app (one that returns from the ``lifespan`` scope) crashes Hypercorn's
  Trio worker at startup, so the app implements lifespan.
* ``keep_alive_max_requests`` (default 1000) would make Hypercorn GOAWAY an h2 connection
  after 1000 streams; it is set very high here so long benchmarks keep their connections.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import itertools
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from functools import partial
from typing import Any

import attrs
import h2.connection
import h2.errors
import h2.exceptions
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

__all__ = [
    "MODEL",
    "FakeBackendDied",
    "FakeLLM",
    "add_arguments",
    "hypercorn_config",
    "main",
    "reply_text",
    "run",
    "serve_fakellm",
]

MODEL = "fake-llm"
"""The one model :class:`FakeLLM` lists (completions echo the request's ``model``)."""

Message = Mapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

HEADER_TOKENS = "x-fake-tokens"
HEADER_DELAY = "x-fake-delay"
HEADER_FIRST_DELAY = "x-fake-first-delay"
HEADER_DIE_AFTER = "x-fake-die-after"
HEADER_STATUS = "x-fake-status"
HEADER_ECHO = "x-fake-echo-headers"
HEADER_ROLE_CHUNK = "x-fake-role-chunk"
HEADER_SINK = "x-fake-sink"
HEADER_BACKEND_ID = "x-backend-id"
HEADER_MODEL_VERSION = "x-model-version"

_TRUE = frozenset({"1", "true", "yes", "on"})
_NO_DIE = frozenset({"", "none", "off", "-1"})
_ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET", "HEAD"),
    "/v1/models": ("GET", "HEAD"),
    "/v1/chat/completions": ("POST",),
}
_ABORT_DRAIN_TIMEOUT = 1.0
"""Longest wait for queued h2 DATA to leave before the RST_STREAM of a die-after."""


class FakeBackendDied(Exception):
    """Raised by the app to abort a response on purpose (die-after)."""


class _BadKnob(ValueError):
    """A malformed ``x-fake-*`` header (answered with 400)."""


def reply_text(n_tokens: int) -> str:
    """The full reply text of an ``n_tokens`` completion: ``"tok0 tok1 ... "``."""
    return "".join(_token(i) for i in range(n_tokens))


def _token(i: int) -> str:
    return f"tok{i} "


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@attrs.frozen
class _Knobs:
    tokens: int
    tokens_from_header: bool
    delay: float
    first_delay: float
    die_after: int | None
    status: int
    role_chunk: bool


@attrs.define
class _Progress:
    """Shared by a completion's producer and its disconnect watcher."""

    finished: bool = False
    """The last message is being sent (or an abort is under way): a disconnect no longer counts."""
    client_gone: bool = False


@attrs.define
class FakeLLM:
    """Configuration, live counters and the ASGI app of one fake backend."""

    backend_id: str = "fake"
    """Sent as ``x-backend-id`` on every response (and as ``system_fingerprint``)."""
    tokens: int = 16
    delay: float = 0.02
    first_delay: float = 0.0
    die_after: int | None = None
    status: int = 200
    model_version: str | None = None
    """Sent as ``x-model-version`` on every response when set."""
    role_chunk: bool = False
    """Start every stream with a role-only chunk (``x-fake-role-chunk``)."""

    requests: int = attrs.field(default=0, init=False)
    """HTTP requests received (any path)."""
    streams_started: int = attrs.field(default=0, init=False)
    """Streaming completions whose response head was sent."""
    streams_completed: int = attrs.field(default=0, init=False)
    """Streaming completions that reached ``data: [DONE]`` (counted as it is handed over)."""
    aborts: int = attrs.field(default=0, init=False)
    """Completions (streamed or not) cut off on purpose by die-after."""
    disconnects: int = attrs.field(default=0, init=False)
    """Completions (streamed or not) whose client went away before the end."""
    last_request_headers: dict[str, str] | None = attrs.field(default=None, init=False)
    """Headers of the latest request: lower-case name -> value, repeats joined ", "."""

    _changed: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)
    _ids: itertools.count[int] = attrs.field(
        factory=lambda: itertools.count(1), init=False, repr=False
    )

    # ---- waiting on the counters -------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; it is re-checked whenever a counter changes."""
        while not predicate():
            await self._changed.wait()

    async def wait_disconnect(self, n: int = 1) -> None:
        """Return once ``disconnects >= n``."""
        await self.wait_until(lambda: self.disconnects >= n)

    async def wait_streams_started(self, n: int = 1) -> None:
        """Return once ``streams_started >= n``."""
        await self.wait_until(lambda: self.streams_started >= n)

    # ---- the ASGI app ------------------------------------------------------------------

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI 3 callable."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method: str = scope["method"]
        path: str = scope["path"]
        headers = _collect_headers(scope["headers"])
        self.requests += 1
        self.last_request_headers = headers
        self._notify()

        sink = method == "POST" and headers.get(HEADER_SINK, "").strip().lower() in _TRUE
        digest = hashlib.sha256()
        size = 0
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            data: bytes = message.get("body", b"")
            if sink:
                digest.update(data)
                size += len(data)
            elif data:
                chunks.append(data)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)

        echo = headers if headers.get(HEADER_ECHO, "").strip().lower() in _TRUE else None
        try:
            knobs = self._knobs(headers)
        except _BadKnob as exc:
            await self._send_error(send, 400, str(exc), "invalid_request_error", echo)
            return
        if knobs.status != 200:
            await self._send_error(
                send, knobs.status, f"fake status {knobs.status}", "fake_error", echo
            )
            return
        if sink:
            result: dict[str, Any] = {"received_bytes": size, "sha256": digest.hexdigest()}
            if echo is not None:
                result["request_headers"] = echo
            await self._send_json(send, 200, result)
            return

        allowed = _ROUTES.get(path)
        if allowed is None:
            await self._send_error(send, 404, f"no route for {path}", "not_found", echo)
            return
        if method not in allowed:
            await self._send_error(
                send,
                405,
                f"method {method} not allowed on {path}",
                "method_not_allowed",
                echo,
                extra_headers=[(b"allow", ", ".join(allowed).encode())],
            )
            return
        if path == "/health":
            await self._send_bytes(send, 200, b"ok", b"text/plain; charset=utf-8")
        elif path == "/v1/models":
            models = {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "muxproxy"}],
            }
            await self._send_json(send, 200, models)
        else:
            await self._chat(receive, send, knobs, body, echo)

    def _knobs(self, headers: Mapping[str, str]) -> _Knobs:
        raw_die = headers.get(HEADER_DIE_AFTER)
        if raw_die is None:
            die_after = self.die_after
        elif raw_die.strip().lower() in _NO_DIE:
            die_after = None
        else:
            die_after = _header_int(HEADER_DIE_AFTER, raw_die, 0, None)
        raw_status = headers.get(HEADER_STATUS)
        return _Knobs(
            tokens=_header_int(HEADER_TOKENS, headers.get(HEADER_TOKENS), 0, None, self.tokens),
            tokens_from_header=HEADER_TOKENS in headers,
            delay=_header_float(HEADER_DELAY, headers.get(HEADER_DELAY), self.delay),
            first_delay=_header_float(
                HEADER_FIRST_DELAY, headers.get(HEADER_FIRST_DELAY), self.first_delay
            ),
            die_after=die_after,
            status=_header_int(HEADER_STATUS, raw_status, 200, 599, self.status),
            role_chunk=(
                headers[HEADER_ROLE_CHUNK].strip().lower() in _TRUE
                if HEADER_ROLE_CHUNK in headers
                else self.role_chunk
            ),
        )

    # ---- chat completions --------------------------------------------------------------

    async def _chat(
        self,
        receive: Receive,
        send: Send,
        knobs: _Knobs,
        body: bytes,
        echo: dict[str, str] | None,
    ) -> None:
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            await self._send_error(
                send, 400, "request body must be a JSON object", "invalid_request_error", echo
            )
            return
        n_tokens = knobs.tokens
        if not knobs.tokens_from_header:
            for key in ("max_tokens", "max_completion_tokens"):
                value = request.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    n_tokens = value
                    break
        model = request.get("model")
        if not isinstance(model, str) or not model:
            model = MODEL
        stream_options = request.get("stream_options")
        include_usage = isinstance(stream_options, dict) and bool(
            stream_options.get("include_usage")
        )
        usage = {
            "prompt_tokens": _prompt_tokens(request.get("messages")),
            "completion_tokens": n_tokens,
        }
        usage["total_tokens"] = usage["prompt_tokens"] + n_tokens
        completion_id = f"chatcmpl-{self.backend_id}-{next(self._ids)}"
        base = {
            "id": completion_id,
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": self.backend_id,
        }
        die_after = knobs.die_after
        if die_after is not None and die_after > n_tokens:
            die_after = None

        progress = _Progress()
        produce: Callable[[_Progress], Awaitable[bool]]
        if request.get("stream"):
            produce = partial(
                self._produce_stream,
                send,
                knobs,
                n_tokens,
                die_after,
                base,
                usage if include_usage else None,
                echo,
            )
        else:
            produce = partial(
                self._produce_whole, send, knobs, n_tokens, die_after, base, usage, echo
            )
        died = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_disconnect, receive, progress, nursery.cancel_scope)
            died = await produce(progress)
            nursery.cancel_scope.cancel()
        if died:
            self.aborts += 1
            self._notify()
            await _reset_h2_stream(send)
            raise FakeBackendDied(f"{self.backend_id}: die-after {die_after} tokens")

    async def _watch_disconnect(
        self, receive: Receive, progress: _Progress, cancel_scope: trio.CancelScope
    ) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not progress.finished:
                    self._client_gone(progress)
                    cancel_scope.cancel()
                return

    def _client_gone(self, progress: _Progress) -> None:
        if not progress.client_gone:
            progress.client_gone = True
            self.disconnects += 1
            self._notify()

    async def _send_or_gone(self, send: Send, message: dict[str, Any], progress: _Progress) -> bool:
        """Send; a transport failure counts as the client going away (returns False)."""
        try:
            await send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self._client_gone(progress)
            return False
        return True

    async def _produce_stream(
        self,
        send: Send,
        knobs: _Knobs,
        n_tokens: int,
        die_after: int | None,
        base: dict[str, Any],
        usage: dict[str, int] | None,
        echo: dict[str, str] | None,
        progress: _Progress,
    ) -> bool:
        """Stream one completion as SSE; True when it must die (die-after)."""
        start = trio.current_time()
        self.streams_started += 1
        self._notify()
        head = {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream"),
                (b"cache-control", b"no-cache"),
                *self._common_headers(),
            ],
        }
        if not await self._send_or_gone(send, head, progress):
            return False

        def chunk(delta: dict[str, Any], finish_reason: str | None, first: bool) -> dict[str, Any]:
            obj: dict[str, Any] = {
                **base,
                "object": "chat.completion.chunk",
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ],
            }
            if first and echo is not None:
                obj["request_headers"] = echo
            return obj

        def event(obj: object, more_body: bool = True) -> dict[str, Any]:
            return {
                "type": "http.response.body",
                "body": b"data: " + _dumps(obj) + b"\n\n",
                "more_body": more_body,
            }

        role_only = knobs.role_chunk
        if role_only:
            role = {"role": "assistant", "content": ""}
            if not await self._send_or_gone(send, event(chunk(role, None, True)), progress):
                return False
        for i in range(n_tokens):
            if die_after is not None and i >= die_after:
                progress.finished = True
                return True
            await trio.sleep_until(start + knobs.first_delay + i * knobs.delay)
            delta = {"content": _token(i)}
            first = i == 0 and not role_only
            if first:
                delta = {"role": "assistant", **delta}
            if not await self._send_or_gone(send, event(chunk(delta, None, first)), progress):
                return False
        if die_after is not None:  # die_after == n_tokens: die before the finish chunk
            progress.finished = True
            return True
        await trio.sleep_until(start + knobs.first_delay)  # no tokens: still wait the first delay
        no_role_yet = n_tokens == 0 and not role_only
        last_delta: dict[str, Any] = {"role": "assistant", "content": ""} if no_role_yet else {}
        if not await self._send_or_gone(
            send, event(chunk(last_delta, "stop", no_role_yet)), progress
        ):
            return False
        if usage is not None:
            usage_chunk = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
            if not await self._send_or_gone(send, event(usage_chunk), progress):
                return False
        # Counted before the send: Hypercorn returns from it only once the data is written
        # (h2) or the connection recycled (h1), after the client may already have seen it.
        progress.finished = True
        self.streams_completed += 1
        self._notify()
        done = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
        await self._send_or_gone(send, done, progress)
        return False

    async def _produce_whole(
        self,
        send: Send,
        knobs: _Knobs,
        n_tokens: int,
        die_after: int | None,
        base: dict[str, Any],
        usage: dict[str, int],
        echo: dict[str, str] | None,
        progress: _Progress,
    ) -> bool:
        """Send one ``chat.completion`` once "generated"; True when it must die (die-after)."""
        start = trio.current_time()
        generated = n_tokens if die_after is None else die_after
        await trio.sleep_until(start + knobs.first_delay + max(generated - 1, 0) * knobs.delay)
        obj: dict[str, Any] = {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply_text(n_tokens)},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }
        if echo is not None:
            obj["request_headers"] = echo
        payload = _dumps(obj)
        progress.finished = True
        head = self._json_head(200, len(payload))
        if not await self._send_or_gone(send, head, progress):
            return False
        if die_after is not None:
            half = {
                "type": "http.response.body",
                "body": payload[: len(payload) // 2],
                "more_body": True,
            }
            await self._send_or_gone(send, half, progress)
            return not progress.client_gone
        await self._send_or_gone(
            send, {"type": "http.response.body", "body": payload, "more_body": False}, progress
        )
        return False

    # ---- plain responses ---------------------------------------------------------------

    def _common_headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(HEADER_BACKEND_ID.encode(), self.backend_id.encode("latin-1"))]
        if self.model_version is not None:
            headers.append((HEADER_MODEL_VERSION.encode(), self.model_version.encode("latin-1")))
        return headers

    def _json_head(
        self, status: int, length: int, extra: Sequence[tuple[bytes, bytes]] = ()
    ) -> dict[str, Any]:
        return {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(length).encode()),
                *self._common_headers(),
                *extra,
            ],
        }

    async def _send_json(
        self,
        send: Send,
        status: int,
        obj: object,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        payload = _dumps(obj)
        await send(self._json_head(status, len(payload), extra_headers))
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    async def _send_bytes(
        self, send: Send, status: int, payload: bytes, content_type: bytes
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(payload)).encode()),
                    *self._common_headers(),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    async def _send_error(
        self,
        send: Send,
        status: int,
        message: str,
        error_type: str,
        echo: dict[str, str] | None,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        obj: dict[str, Any] = {
            "error": {"message": message, "type": error_type, "param": None, "code": status}
        }
        if echo is not None:
            obj["request_headers"] = echo
        await self._send_json(send, status, obj, extra_headers)


# ---- helpers ---------------------------------------------------------------------------


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _collect_headers(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


def _header_int(name: str, raw: str | None, low: int, high: int | None, default: int = 0) -> int:
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise _BadKnob(f"{name}: expected an integer, got {raw!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise _BadKnob(f"{name}: expected an integer {bounds}, got {value}")
    return value


def _header_float(name: str, raw: str | None, default: float) -> float:
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise _BadKnob(f"{name}: expected seconds, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise _BadKnob(f"{name}: expected finite seconds >= 0, got {raw!r}")
    return value


def _prompt_tokens(messages: object) -> int:
    """A crude prompt size: whitespace-separated words of the string contents."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content.split())
    return total


async def _reset_h2_stream(send: Send) -> None:
    """Reset the HTTP/2 stream behind ``send`` if Hypercorn serves it over h2, else no-op.

    Hypercorn, when an app raises mid-response, closes an HTTP/1.1 connection but leaves an
    h2 stream open. Here ``send`` is Hypercorn's ``HTTPStream.app_send``; its stream's
    ``send`` is ``H2Protocol.stream_send``. Queued DATA is let out first (so the client
    gets exactly the tokens sent), then RST_STREAM(INTERNAL_ERROR) is written, and the
    stream's buffer is marked complete so Hypercorn's sender drops it.
    """
    stream: Any = getattr(send, "__self__", None)
    protocol: Any = getattr(getattr(stream, "send", None), "__self__", None)
    connection = getattr(protocol, "connection", None)
    if not isinstance(connection, h2.connection.H2Connection):
        return
    stream_id: int = stream.stream_id
    buffer: Any = getattr(protocol, "stream_buffers", {}).get(stream_id)
    if buffer is not None and len(buffer.buffer) > 0:
        with trio.move_on_after(_ABORT_DRAIN_TIMEOUT):
            await buffer.drain()
    try:
        connection.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.INTERNAL_ERROR)
    except h2.exceptions.ProtocolError:
        return  # the stream or connection is already closed
    await protocol._flush()
    if buffer is not None:
        buffer.set_complete()
        protocol.priority.unblock(stream_id)
        await protocol.has_data.set()


class _DropDeliberateAborts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], FakeBackendDied))


_server_log = logging.getLogger("muxproxy.testing.fakellm.server")
_server_log.setLevel(logging.WARNING)
_server_log.addFilter(_DropDeliberateAborts())


def hypercorn_config(host: str = "127.0.0.1", port: int = 0) -> HypercornConfig:
    """The Hypercorn configuration :func:`serve_fakellm` uses (quiet, h2-friendly)."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = _server_log
    config.keep_alive_timeout = 75.0
    config.keep_alive_max_requests = 2**62
    config.h2_max_concurrent_streams = 1000
    config.graceful_timeout = 1.0
    return config


async def serve_fakellm(
    fake: FakeLLM,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``fake`` with Hypercorn's Trio worker until cancelled.

    ``task_status.started(port)`` reports the port really bound (useful with ``port=0``)::

        port = await nursery.start(serve_fakellm, fake)
    """
    app: Any = fake.app
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn_serve, app, hypercorn_config(host, port))
        )
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


# ---- command line ----------------------------------------------------------------------


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected finite seconds >= 0, got {text}")
    return value


def _status(text: str) -> int:
    value = int(text)
    if not 200 <= value <= 599:
        raise argparse.ArgumentTypeError(f"expected a status in 200..599, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``muxproxy fakellm`` options to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument(
        "--port", type=_non_negative_int, default=0, help="port to bind (0: any free port)"
    )
    parser.add_argument(
        "--id", dest="backend_id", default="fake", help="backend id, sent as x-backend-id"
    )
    parser.add_argument(
        "--model-version",
        default=None,
        metavar="V",
        help="model version, sent as x-model-version on every response",
    )
    parser.add_argument("--tokens", type=_non_negative_int, default=16, help="tokens per reply")
    parser.add_argument("--delay", type=_seconds, default=0.02, help="seconds between tokens")
    parser.add_argument(
        "--first-delay", type=_seconds, default=0.0, help="seconds before the first token"
    )
    parser.add_argument(
        "--die-after",
        type=_non_negative_int,
        default=None,
        help="abort every completion after N tokens",
    )
    parser.add_argument(
        "--status", type=_status, default=200, help="answer every request with this status"
    )
    parser.add_argument(
        "--role-chunk",
        action="store_true",
        help="start every stream with a role-only chunk, as vLLM does",
    )


def run(args: argparse.Namespace) -> int:
    """Run a fake backend from parsed :func:`add_arguments` options until interrupted."""
    fake = FakeLLM(
        backend_id=args.backend_id,
        tokens=args.tokens,
        delay=args.delay,
        first_delay=args.first_delay,
        die_after=args.die_after,
        status=args.status,
        model_version=args.model_version,
        role_chunk=args.role_chunk,
    )

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_fakellm, fake, host=args.host, port=args.port))
            print(f"fakellm {fake.backend_id} listening on {args.host}:{port}", flush=True)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(serve)
    except (OSError, BaseExceptionGroup) as exc:
        # Hypercorn binds inside nested nurseries: a busy port arrives as an OSError wrapped
        # in exception groups. Anything else is a bug and keeps its traceback.
        error = _listen_error(exc)
        if error is None:
            raise
        where = f"{args.host}:{args.port}"
        if error.errno == errno.EADDRINUSE:
            message = f"port {args.port} is in use ({where}); pick another --port, or 0 for any"
        else:
            message = f"cannot listen on {where}: {error.strerror or error}"
        print(f"muxproxy fakellm: {message}", file=sys.stderr)
        return 1
    return 0


def _listen_error(exc: BaseException) -> OSError | None:
    """The one ``OSError`` inside ``exc`` (nested exception groups), if that is all it is."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None


def main(argv: list[str] | None = None) -> int:
    """``python -m muxproxy.testing.fakellm`` (the same options as ``muxproxy fakellm``)."""
    parser = argparse.ArgumentParser(
        prog="muxproxy fakellm", description="A fake OpenAI-compatible LLM backend."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
