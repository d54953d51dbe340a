"""The fake LLM backend's ASGI application: :class:`FakeLLM` and what it answers.

A plain ASGI 3 application (:attr:`FakeLLM.app`, no framework), served by
:func:`~muxproxy.testing.fakellm.serve_fakellm` (``server.py``); it knows nothing of the
server under it.

What it obeys:

* The OpenAI chat-completions wire format, closely enough for the ``openai`` Python SDK:
  ``POST /v1/chat/completions`` (``stream`` true: ``text/event-stream`` of
  ``chat.completion.chunk`` objects, one ASGI body message per event, closed by
  ``data: [DONE]``; ``stream`` false: one ``chat.completion`` object with ``usage``; the
  objects and messages themselves are ``completions.py``'s),
  ``GET /v1/models`` (a list holding the one model ``fake-llm``) and ``GET /health``
  (``200 ok``); ``/v1/responses``, ``/v1/messages``: ``apistream.py``. Else 404 (or 405).
* ``GET /metrics``: the engine model's state in Prometheus text under vLLM's metric names
  (``metrics.py``); all zeros while the model is off, so any fake can be polled.
* The ASGI 3 HTTP spec: the request body is always read to its end before answering, and
  ``http.disconnect`` is watched for while a completion is being generated, so a client
  that goes away is noticed at once, not at the next token write.

Every response the app makes carries ``x-backend-id: <id>``, and ``x-model-version: <v>``
when the backend is given a model version (``--model-version``: a gray release moves traffic
from one version to the next, and a client can tell which one answered). Reply text is
``tok0 tok1 ... tok<n-1> ``, the same for every request of ``n`` tokens (``answer.py``).

A chat completion with ``continue_final_message: true`` (and ``add_generation_prompt``
false or left out), as vLLM and SGLang take it, continues its final assistant message: that
message must hold the answer's first ``k`` tokens, and the reply is the rest of the answer,
from token ``k`` (an ordinary reply in every other way: its own ``id``, role chunk, finish
chunk, ``usage`` and die-after). Which ``n`` the rest runs to (``x-fake-tokens`` is the
whole answer's length, ``max_tokens`` the new tokens', as in vLLM) and the 400s it answers
are ``answer.py``'s.

The knobs (``knobs.py``: token count, delays, die-after, status, ...) come from the
:class:`FakeLLM` attributes, overridden per request by ``x-fake-*`` headers. Precedence, after
the request body is read: a malformed knob header answers 400, then a status other than 200
answers that status, then ``x-fake-sink``, then routing (404/405).

A non-streaming completion waits as long as streaming it would have taken
(``first_delay + (n - 1) * delay``); with die-after it sends the head (with the full
``content-length``) and half the body, then aborts by raising :class:`FakeBackendDied`
(which, served over h2, ``server.py`` turns into a reset of the stream). Malformed knob
headers or JSON answer 400.

The engine model is opt-in (``max_running``, ``kv_blocks``, ``ttft_base``,
``prefill_per_token``, ``prefill_chunk``: any one given turns it on; the model is
``engine.py``, its Trio side ``scheduler.py``). On, a completion's stream head and role
chunk still go out at once (vLLM sends the head before it schedules the request), then its
generation waits first come first served for one of ``max_running`` slots, is looked up in
the prefix cache when let in, and its first token comes ``first_delay + ttft_base +
prefill_per_token * uncached prompt tokens`` after that, the rest every ``delay``; the slot
and cache blocks are given back, the generated tokens' blocks cached, when the last token is
out (or the client leaves, or die-after fires). A client that leaves while waiting leaves the
line at once. Off, none of this happens and timings are as above.

The step model (``prefill_chunk``, with the engine model; ``batch.py``, ``steps.py``) replaces
that private timetable with continuous batching, as vLLM V1 and SGLang run: a generation let
in waits ``ttft_base + first_delay``, then joins the engine's one batch, whose loop runs steps
of ``delay`` plus ``prefill_per_token`` for each prefill token in the step (at most
``prefill_chunk`` a step, shared first come first served among the generations still
prefilling their uncached tokens). Each step, every generation done with its prefill has its
next token out, so all running streams get a token once a step, and a cold prompt makes every
one of them late while it prefills. The first token comes at the end of the step that
completes the prefill. Per-request ``x-fake-delay`` does not apply (one engine, one pace).

Observability: :class:`FakeLLM` counts ``requests``, ``streams_started``,
``streams_completed``, ``aborts`` (die-after fired), ``disconnects`` (completions,
streamed or not, whose client went away before the end) and ``continuations`` (completions
continuing a final assistant message), keeps ``last_request_headers``,
shows the engine model's ``running`` and ``waiting`` generations and its
``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens), and offers
:meth:`FakeLLM.wait_disconnect` / :meth:`FakeLLM.wait_until` to await any of them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio

from muxproxy.asgi import serve_lifespan
from muxproxy.testing.fakellm.answer import BadContinuation, Reply, plan_reply
from muxproxy.testing.fakellm.apistream import Generation, produce_stream, produce_whole
from muxproxy.testing.fakellm.completions import (
    body_message,
    chunk,
    completion_base,
    done_event,
    sse_event,
    stream_head,
    usage_chunk,
    usage_of,
    whole_completion,
)
from muxproxy.testing.fakellm.engine import DEFAULT_BLOCK_TOKENS, EngineConfig, EnginePrompt
from muxproxy.testing.fakellm.knobs import (
    HEADER_ECHO,
    HEADER_SINK,
    BadKnob,
    Knobs,
    collect_headers,
    is_true,
    read_knobs,
)
from muxproxy.testing.fakellm.lora import LoraSlots, requested_model
from muxproxy.testing.fakellm.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from muxproxy.testing.fakellm.pacing import Timetable, TokenClock
from muxproxy.testing.fakellm.responses import Responder, dumps
from muxproxy.testing.fakellm.scheduler import Engine
from muxproxy.testing.fakellm.wires import PREFILL, WIRES

MODEL = "fake-llm"
"""The one model :class:`FakeLLM` lists (completions echo the request's ``model``)."""

Message = Mapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET", "HEAD"),
    "/v1/models": ("GET", "HEAD"),
    "/metrics": ("GET", "HEAD"),
    "/v1/chat/completions": ("POST",),
    "/v1/responses": ("POST",),
    "/v1/messages": ("POST",),
}


class FakeBackendDied(Exception):
    """Raised by the app to abort a response on purpose (die-after)."""


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
    max_running: int | None = None
    """Engine model: at most this many generations at once, the rest wait in line."""
    kv_blocks: int | None = None
    """Engine model: blocks of its prefix KV cache."""
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Engine model: tokens per KV block."""
    ttft_base: float | None = None
    """Engine model: seconds from admission to the first token, before prefill."""
    prefill_per_token: float | None = None
    """Engine model: seconds of prefill per prompt token not found cached."""
    prefill_chunk: int | None = None
    """Engine model, step model: prefill tokens per engine step (see ``batch.py``)."""
    lora: LoraSlots | None = None
    """The LoRA adapters it holds and reports (``lora.py``); None: no LoRA."""

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
    continuations: int = attrs.field(default=0, init=False)
    """Completions that continue a final assistant message (``continue_final_message``),
    counted once the request is accepted."""
    last_request_headers: dict[str, str] | None = attrs.field(default=None, init=False)
    """Headers of the latest request: lower-case name -> value, repeats joined ", "."""

    engine: Engine = attrs.field(init=False, repr=False)
    """The engine model, made from the six options above (read once, here, and with the step
    model ``delay`` too); it is on when any of them but ``block_tokens`` is given.
    ``/metrics`` shows its state, on or off."""

    _changed: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)
    _ids: itertools.count[int] = attrs.field(
        factory=lambda: itertools.count(1), init=False, repr=False
    )

    def __attrs_post_init__(self) -> None:
        config = EngineConfig(
            max_running=self.max_running,
            kv_blocks=self.kv_blocks,
            block_tokens=self.block_tokens,
            ttft_base=self.ttft_base,
            prefill_per_token=self.prefill_per_token,
            prefill_chunk=self.prefill_chunk,
            decode_seconds=self.delay if self.prefill_chunk is not None else 0.0,
        )
        self.engine = Engine(config, MODEL, self._notify, self.lora)

    @property
    def running(self) -> int:
        """Generations the engine model runs (0 when it is off)."""
        return self.engine.running

    @property
    def waiting(self) -> int:
        """Generations waiting in the engine model's line (0 when it is off)."""
        return self.engine.waiting

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the engine model's prefix cache (0 without one)."""
        return 0 if self.engine.cache is None else self.engine.cache.queried_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the engine model's prefix cache (0 without one)."""
        return 0 if self.engine.cache is None else self.engine.cache.hit_tokens

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
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method: str = scope["method"]
        path: str = scope["path"]
        headers = collect_headers(scope["headers"])
        self.requests += 1
        respond = self._responder()
        self.last_request_headers = headers
        self._notify()

        sink = method == "POST" and is_true(headers.get(HEADER_SINK, ""))
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

        echo = headers if is_true(headers.get(HEADER_ECHO, "")) else None
        try:
            knobs = read_knobs(headers, self)
        except BadKnob as exc:
            await respond.send_error(send, 400, str(exc), "invalid_request_error", echo)
            return
        if knobs.status != 200:
            await respond.send_error(
                send, knobs.status, f"fake status {knobs.status}", "fake_error", echo
            )
            return
        if sink:
            result: dict[str, Any] = {"received_bytes": size, "sha256": digest.hexdigest()}
            if echo is not None:
                result["request_headers"] = echo
            await respond.send_json(send, 200, result)
            return

        allowed = _ROUTES.get(path)
        if allowed is None:
            await respond.send_error(send, 404, f"no route for {path}", "not_found", echo)
            return
        if method not in allowed:
            await respond.send_error(
                send,
                405,
                f"method {method} not allowed on {path}",
                "method_not_allowed",
                echo,
                extra=[(b"allow", ", ".join(allowed).encode())],
            )
            return
        if path == "/health":
            await respond.send_bytes(send, 200, b"ok", b"text/plain; charset=utf-8")
        elif path == "/metrics":
            metrics = self.engine.render_metrics()
            await respond.send_bytes(send, 200, metrics, METRICS_CONTENT_TYPE.encode())
        elif path == "/v1/models":
            models = {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "muxproxy"}],
            }
            await respond.send_json(send, 200, models)
        else:
            await self._chat(receive, send, knobs, body, echo, path)

    # ---- chat completions --------------------------------------------------------------

    async def _chat(
        self,
        receive: Receive,
        send: Send,
        knobs: Knobs,
        body: bytes,
        echo: dict[str, str] | None,
        path: str,
    ) -> None:
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            await self._responder().send_error(
                send, 400, "request body must be a JSON object", "invalid_request_error", echo
            )
            return
        n_tokens = knobs.tokens
        counts_new = False
        if not knobs.tokens_from_header:
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                value = request.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    n_tokens = value
                    counts_new = True
                    break
        try:
            reply = plan_reply(request, n_tokens, counts_new=counts_new, prefill=path in PREFILL)
        except BadContinuation as exc:
            await self._responder().send_error(
                send, 400, str(exc), "invalid_request_error", echo, param=exc.param
            )
            return
        if reply.continued:
            self.continuations += 1
            self._notify()
        model = requested_model(request, MODEL, self.lora)  # an adapter is loaded
        stream_options = request.get("stream_options")
        include_usage = isinstance(stream_options, dict) and bool(
            stream_options.get("include_usage")
        )
        usage = usage_of(request.get("messages"), reply.count)
        completion_id = f"chatcmpl-{self.backend_id}-{next(self._ids)}"
        base = completion_base(completion_id, int(time.time()), model, self.backend_id)
        die_after = knobs.die_after
        if die_after is not None and die_after > reply.count:
            die_after = None
        prompt = EnginePrompt.of(request) if self.engine.config.enabled else None

        progress = _Progress()
        produce: Callable[[_Progress], Awaitable[bool]]
        make_wire = WIRES.get(path)
        if make_wire is not None:
            wire = make_wire(request, model, completion_id, int(time.time()), reply.count)
            gen = partial(self._lend, send, knobs, reply, die_after, prompt)
            if request.get("stream"):
                started = partial(self._count, "streams_started")
                produce = lambda p: produce_stream(wire, gen(p), started)  # noqa: E731
            else:
                produce = lambda p: produce_whole(wire, gen(p))  # noqa: E731
        elif request.get("stream"):
            produce = partial(
                self._produce_stream,
                send,
                knobs,
                reply,
                die_after,
                base,
                usage if include_usage else None,
                echo,
                prompt,
            )
        else:
            produce = partial(
                self._produce_whole, send, knobs, reply, die_after, base, usage, echo, prompt
            )
        died = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_disconnect, receive, progress, nursery.cancel_scope)
            died = await produce(progress)
            nursery.cancel_scope.cancel()
        if died:
            self.aborts += 1
            self._notify()
            raise FakeBackendDied(f"{self.backend_id}: die-after {die_after} tokens")

    @asynccontextmanager
    async def _generating(
        self, prompt: EnginePrompt | None, start: float, knobs: Knobs, tokens: int
    ) -> AsyncIterator[TokenClock]:
        """Hold the engine model for one generation of ``tokens``; yields what paces them.

        Off (``prompt`` is None): a timetable from ``start`` at once. On: waits in the
        engine's line, then a timetable from admission plus the prefill of the uncached prompt
        tokens; in the step model, its place in the engine's batch.
        """
        if prompt is None:
            yield Timetable(start, knobs.first_delay, knobs.delay)
        elif self.engine.batch is not None:
            async with self.engine.batched_generation(
                prompt, tokens=tokens, first_delay=knobs.first_delay
            ) as generation:
                yield generation
        else:
            async with self.engine.timetabled(prompt, knobs.first_delay, knobs.delay) as clock:
                yield clock

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
        knobs: Knobs,
        reply: Reply,
        die_after: int | None,
        base: dict[str, Any],
        usage: dict[str, int] | None,
        echo: dict[str, str] | None,
        prompt: EnginePrompt | None,
        progress: _Progress,
    ) -> bool:
        """Stream one completion as SSE; True when it must die (die-after)."""
        n_tokens = reply.count
        start = trio.current_time()
        self.streams_started += 1
        self._notify()
        if not await self._send_or_gone(send, stream_head(self._responder().common), progress):
            return False

        def event(delta: dict[str, Any], finish_reason: str | None, first: bool) -> dict[str, Any]:
            return sse_event(chunk(base, delta, finish_reason, echo if first else None))

        role_only = knobs.role_chunk
        if role_only:
            role = {"role": "assistant", "content": ""}
            if not await self._send_or_gone(send, event(role, None, True), progress):
                return False
        # The engine model, when on, lets the generation in and prefills it before the
        # clock's first token. vLLM too sends a stream's head before the request is scheduled.
        async with self._generating(prompt, start, knobs, n_tokens) as clock:
            for i in range(n_tokens):
                if die_after is not None and i >= die_after:
                    progress.finished = True
                    return True
                await clock.wait_generated(i + 1)
                delta = {"content": reply.token(i)}
                first = i == 0 and not role_only
                if first:
                    delta = {"role": "assistant", **delta}
                if not await self._send_or_gone(send, event(delta, None, first), progress):
                    return False
            if die_after is not None:  # die_after == n_tokens: die before the finish chunk
                progress.finished = True
                return True
            # No tokens: still wait the first delay (and the prefill).
            await clock.wait_generated(n_tokens)
            no_role_yet = n_tokens == 0 and not role_only
            last_delta: dict[str, Any] = {"role": "assistant", "content": ""} if no_role_yet else {}
            if not await self._send_or_gone(send, event(last_delta, "stop", no_role_yet), progress):
                return False
            if usage is not None and not await self._send_or_gone(
                send, sse_event(usage_chunk(base, usage)), progress
            ):
                return False
        # Counted before the send: Hypercorn returns from it only once the data is written
        # (h2) or the connection recycled (h1), after the client may already have seen it.
        progress.finished = True
        self.streams_completed += 1
        self._notify()
        await self._send_or_gone(send, done_event(), progress)
        return False

    async def _produce_whole(
        self,
        send: Send,
        knobs: Knobs,
        reply: Reply,
        die_after: int | None,
        base: dict[str, Any],
        usage: dict[str, int],
        echo: dict[str, str] | None,
        prompt: EnginePrompt | None,
        progress: _Progress,
    ) -> bool:
        """Send one ``chat.completion`` once "generated"; True when it must die (die-after)."""
        start = trio.current_time()
        generated = reply.count if die_after is None else die_after
        async with self._generating(prompt, start, knobs, generated) as clock:
            await clock.wait_generated(generated)
        payload = dumps(whole_completion(base, reply.text, usage, echo))
        progress.finished = True
        head = self._responder().json_head(200, len(payload))
        if not await self._send_or_gone(send, head, progress):
            return False
        if die_after is not None:
            half = body_message(payload[: len(payload) // 2], more_body=True)
            await self._send_or_gone(send, half, progress)
            return not progress.client_gone
        await self._send_or_gone(send, body_message(payload, more_body=False), progress)
        return False

    def _lend(
        self,
        send: Send,
        knobs: Knobs,
        reply: Reply,
        die_after: int | None,
        prompt: EnginePrompt | None,
        progress: _Progress,
    ) -> Generation:
        def finishing(complete: bool) -> None:
            progress.finished = True
            if complete:
                self._count("streams_completed")

        start = trio.current_time()
        responder = self._responder()
        return Generation(
            reply,
            die_after,
            partial(self._send_or_gone, send, progress=progress),
            partial(self._generating, prompt, start, knobs),
            stream_head(responder.common),
            partial(responder.json_head, 200),
            finishing,
        )

    def _count(self, counter: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        self._notify()

    def _responder(self) -> Responder:
        return Responder.for_backend(self.backend_id, self.model_version)
