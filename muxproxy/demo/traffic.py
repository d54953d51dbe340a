"""The demo's traffic: conversations, each a session key and turn after turn of streamed
chat completions.

A fixed number of chat slots (``Settings.conversations``) run conversations one after
another until the demo's end: half each on a keep-alive HTTP/1.1 connection of its own, half
as streams multiplexed on the demo's one HTTP/2 connection. A turn asks for a streamed chat
completion (OpenAI's shape) with the conversation so far, its session key in ``X-Chat-ID``
and its request id (``chat-07.3``: conversation 7, turn 3) in ``X-Request-ID``, which the
proxy logs, so the demo can tell which turn a retry concerns.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable

import trio

from muxproxy.demo.board import Conversation, Turn
from muxproxy.demo.clients import H1Client, RequestFailed
from muxproxy.demo.fleet import CHAT_PATH, SESSION_HEADER
from muxproxy.demo.stage import Demo
from muxproxy.testing.fakellm import MODEL

TURNS = (3, 5)
"""Turns per conversation, at least and at most."""
TURN_TIMEOUT = 30.0
"""Seconds one turn may take before the demo counts it failed."""
QUESTIONS = (
    "What is a KV cache?",
    "Why do streams stick to one GPU?",
    "What happens when a GPU dies mid-answer?",
    "How does a gray release move traffic?",
    "Why HTTP/2 for many streams?",
    "What is time to first token?",
)


class _TurnListener:
    """Writes what a client receives into its turn."""

    def __init__(self, turn: Turn, now: Callable[[], float]) -> None:
        self.turn = turn
        self.now = now

    def on_head(self, status: int, headers: dict[str, str]) -> None:
        self.turn.status = status
        self.turn.backend = headers.get("x-backend-id")
        self.turn.version = headers.get("x-model-version")

    def on_data(self, data: str) -> None:
        self.turn.on_data(data, self.now())


def chat_body(conversation: Conversation, tokens: int) -> bytes:
    """The next turn's request: the conversation so far, and a new question."""
    messages: list[dict[str, str]] = []
    for turn in conversation.turns[:-1]:
        messages.append({"role": "user", "content": QUESTIONS[turn.index % len(QUESTIONS)]})
        messages.append({"role": "assistant", "content": "".join(turn.text)})
    index = len(conversation.turns)
    messages.append({"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]})
    document = {"model": MODEL, "stream": True, "max_tokens": tokens, "messages": messages}
    return json.dumps(document).encode()


Post = Callable[[str, list[tuple[str, str]], bytes, _TurnListener], Awaitable[None]]


async def one_turn(demo: Demo, conversation: Conversation, post: Post, tokens: int) -> Turn:
    board = demo.board
    turn = board.begin_turn(conversation, tokens, demo.now())
    headers = [
        ("Content-Type", "application/json"),
        (SESSION_HEADER, conversation.key),
        ("X-Request-ID", turn.request_id),
    ]
    error = None
    try:
        with trio.fail_after(TURN_TIMEOUT):
            await post(
                CHAT_PATH, headers, chat_body(conversation, tokens), _TurnListener(turn, demo.now)
            )
    except RequestFailed as exc:
        error = str(exc)
    except trio.TooSlowError:
        error = f"no complete answer within {TURN_TIMEOUT:g}s"
    board.end_turn(turn, demo.now(), error)
    return turn


async def chat_slot(demo: Demo, slot: int, http2: bool) -> None:
    """Conversations one after another, turn after turn, until the demo's end."""
    settings = demo.settings
    rng = random.Random(settings.seed * 1000 + slot)
    await trio.sleep(rng.uniform(0, 6 * settings.delay))  # not all in step
    client = None if http2 else H1Client(demo.proxy.port)
    if client is not None:
        demo.h1_clients.append(client)
    post: Post = demo.h2.post if client is None else client.post
    protocol = "HTTP/2" if http2 else "HTTP/1.1"
    try:
        while trio.current_time() < demo.stop_at:
            conversation = Conversation(key=demo.new_key(), protocol=protocol)
            for _ in range(rng.randint(*TURNS)):
                if trio.current_time() >= demo.stop_at:
                    break
                low, high = settings.tokens // 2, settings.tokens * 3 // 2
                await one_turn(demo, conversation, post, rng.randint(max(low, 2), max(high, 3)))
                think = rng.uniform(2, 8) * settings.delay
                await trio.sleep_until(min(trio.current_time() + think, demo.stop_at))
            conversation.ended = True
    finally:
        if client is not None:
            await client.aclose()


async def run_traffic(demo: Demo) -> None:
    """Every chat slot, until each has finished its turn running at the end."""
    count = demo.settings.conversations
    async with trio.open_nursery() as nursery:
        for slot in range(count):
            nursery.start_soon(chat_slot, demo, slot, slot % 2 == 1)
