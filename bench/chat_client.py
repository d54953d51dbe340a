"""The multi-tenant chat load of ``llm_routing.py``: its users, their conversations, one turn.

The workload: ``--prompts`` system prompts (:func:`system_prompts`, each distinct from its
first byte on, so that neither a prefix cache block nor a prefix-affinity key is shared by
two of them); ``--users`` users (:func:`make_users`), each with one of them, drawn with Zipf
popularity; each user holds one conversation at a time, of ``--turns`` turns, and sends a
turn as OpenAI chat messages carrying the whole history (the system prompt, the earlier
questions, the engine's earlier replies, a new question of ``--user-bytes`` bytes) with a
``max_tokens`` drawn from ``--tokens``. Every user draws from a ``random.Random`` of its own,
so a user's turns are the same under every policy whatever the order the requests end in.

The client: one keep-alive HTTP/1.1 connection per user (:class:`HttpConn`, h11 over a Trio
socket stream: a few µs of parsing per event, so that on a small machine the client takes
little of the CPU the proxy and the engines need). :func:`turn` sends one turn and measures
it on the client's clock (``time.monotonic_ns``) as vLLM's serving benchmark does: time to
the response head, TTFT (request sent -> the first SSE event whose delta carries content;
the role-only chunk some servers send first does not count), the gaps between content
events (events arriving in one read have a gap of 0), the end, the status, the engine that
answered (``x-backend-id``). A reply that came whole joins the user's history.

:func:`capacity` computes what the fleet can carry from the engine model's options
(``muxproxy/testing/fakellm/engine.py``, ``steps.py``), with every system prompt cached: with
private prefill a request holds one of ``max_running`` slots for ``ttft_base +
prefill_per_token * uncached prompt tokens + (max_tokens - 1) * delay``; in the step model
(``--prefill-chunk``) its prefill stretches every running stream's steps instead, and the
capacity solves Little's law with steps that last longer the more the engine prefills
(:func:`engine_capacity` says how).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import h11
import trio

TOKEN_BYTES = 4
"""Bytes of prompt text per token in the fake engine (``muxproxy/testing/fakellm/engine.py``)."""
REPLY_BYTES_PER_TOKEN = 7
"""About what a fake reply token (``"tok123 "``) weighs when it comes back as history."""
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


@dataclass
class User:
    """One user: a system prompt, a conversation (history), at most one request in flight."""

    uid: int
    system: str
    prompt_index: int
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)
    turns_left: int = 0
    busy: bool = False
    conn: HttpConn | None = None

    def next_turn(self, args: argparse.Namespace) -> tuple[list[dict[str, str]], int, int]:
        """(messages to send, max_tokens, turn number); a new conversation when one ends."""
        if self.turns_left <= 0:
            self.messages = [{"role": "system", "content": self.system}]
            self.turns_left = self.rng.randint(*args.turns)
        question = {"role": "user", "content": words(self.rng, self.rng.randint(*args.user_bytes))}
        turn = len(self.messages) // 2 + 1
        return [*self.messages, question], self.rng.randint(*args.tokens), turn

    def turn_done(self, sent: list[dict[str, str]], reply: str | None) -> None:
        """A turn ended: its question and reply join the history (a failed turn is dropped)."""
        self.turns_left -= 1
        if reply is not None:
            self.messages = [*sent, {"role": "assistant", "content": reply}]


def make_users(args: argparse.Namespace, prompts: list[str]) -> list[User]:
    rng = random.Random(args.seed + 1)
    popularity = [(k + 1) ** -args.zipf for k in range(len(prompts))]
    picks = rng.choices(range(len(prompts)), weights=popularity, k=args.users)
    return [
        User(uid=u, system=prompts[k], prompt_index=k, rng=random.Random(args.seed * 7919 + u))
        for u, k in enumerate(picks)
    ]


@dataclass(frozen=True)
class TurnMeans:
    """Means over turns drawn as the users draw theirs."""

    uncached_tokens: float
    """Prompt tokens prefilled: the conversation so far and the new question (and the system
    prompt, when it is not cached)."""
    tokens: float
    """``max_tokens``."""
    steps: float
    """Step model: steps a request is in the batch, ``ceil(uncached / chunk) + max_tokens - 1``
    (its prefill's steps; its first token comes with the last of them)."""


def turn_means(args: argparse.Namespace, system_tokens: int = 0, turns: int = 2000) -> TurnMeans:
    """:class:`TurnMeans` of ``turns`` turns of conversations drawn as the users draw theirs,
    with ``system_tokens`` more to prefill every turn (0: the system prompt is cached)."""
    rng = random.Random(args.seed + 2)
    uncached = tokens = steps = 0.0
    done = 0
    chunk: int = args.prefill_chunk
    while done < turns:
        history_bytes = 0
        for _ in range(rng.randint(*args.turns)):
            history_bytes += rng.randint(*args.user_bytes)
            max_tokens = rng.randint(*args.tokens)
            prompt = system_tokens + history_bytes / TOKEN_BYTES
            uncached += prompt
            tokens += max_tokens
            if chunk:
                steps += math.ceil(prompt / chunk) + max_tokens - 1
            history_bytes += max_tokens * REPLY_BYTES_PER_TOKEN
            done += 1
    return TurnMeans(uncached_tokens=uncached / done, tokens=tokens / done, steps=steps / done)


def engine_capacity(args: argparse.Namespace, system_tokens: int = 0) -> float:
    """Requests/s one engine completes at most with every system prompt cached (or with
    ``system_tokens`` of it prefilled every turn).

    Private prefill (``--prefill-chunk 0``): a request holds one of the ``S`` slots for
    ``b + p * U + (T - 1) * d`` (``b`` the base, ``p`` the prefill per token, ``U`` its uncached
    tokens, ``T`` its tokens, ``d`` the delay), so ``X = S / mean slot time``.

    Step model (``--prefill-chunk c``): a step lasts ``d`` plus ``p`` per prefill token in it.
    At ``X`` requests/s the engine spends the fraction ``a * X`` of its time prefilling
    (``a = p * mean U``), so a step lasts ``D = d / (1 - a * X)`` on average; a request holds
    its slot for ``b + K * D`` (``K``: :attr:`TurnMeans.steps`), and with every slot taken
    (Little's law) ``S = X * (b + K * D)``, i.e. ``a*b*X**2 - (a*S + b + K*d)*X + S = 0``,
    whose smaller root is the capacity (``a*X < 1``). It is capped by the prefill a full chunk
    a step can do, ``c / (d + c * p)`` tokens/s, over ``mean U``.
    """
    means = turn_means(args, system_tokens)
    slots: int = args.max_running
    b, p, d = args.ttft_base, args.prefill_per_token, args.delay
    if not args.prefill_chunk:
        return slots / (b + p * means.uncached_tokens + (means.tokens - 1) * d)
    a = p * means.uncached_tokens
    linear = a * slots + b + means.steps * d
    if a * b == 0:
        x = slots / linear
    else:
        x = (linear - math.sqrt(linear * linear - 4 * a * b * slots)) / (2 * a * b)
    if means.uncached_tokens == 0:
        return x
    chunk = args.prefill_chunk
    return min(x, chunk / (d + chunk * p) / means.uncached_tokens)


def service_seconds(args: argparse.Namespace) -> float:
    """Mean time a request holds an engine slot at capacity (Little's law: slots over
    :func:`engine_capacity`); in the step model it grows with the load, as steps stretch."""
    return args.max_running / engine_capacity(args)


def capacity(args: argparse.Namespace, system_tokens: int = 0) -> float:
    """Requests/s the fleet completes at most with every system prompt cached (or with
    ``system_tokens`` of it prefilled every turn)."""
    return args.engines * engine_capacity(args, system_tokens)


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


async def chat(
    user: User,
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


async def turn(
    user: User,
    args: argparse.Namespace,
    outcome: Outcome,
    gaps: array[int] | None,
    ended: Callable[[], None],
) -> None:
    """One turn of ``user``, start to end, whatever happens (``--request-timeout``, errors,
    cancellation): ``outcome`` filled in, inter-token gaps (ns) added to ``gaps`` unless it is
    None; then the user is free again and ``ended()`` is called."""
    sent, outcome.max_tokens, outcome.turn = user.next_turn(args)
    reply = None
    start = time.monotonic_ns()
    try:
        with trio.move_on_after(args.request_timeout) as scope:
            reply = await chat(user, outcome, sent, gaps)
        if scope.cancelled_caught:
            outcome.result = "timeout"
    except NET_ERRORS as exc:
        outcome.result = f"error: {type(exc).__name__}"
    finally:
        if outcome.result != "ok" and user.conn is not None:
            with trio.CancelScope(shield=True):
                await user.conn.close()
        if outcome.e2e_s is None:  # cut (timeout, error, the end of the drain): time so far
            outcome.e2e_s = (time.monotonic_ns() - start) / 1e9
        user.turn_done(sent, reply)
        user.busy = False
        ended()
