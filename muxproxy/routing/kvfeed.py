"""One engine's KV-event subscription as the router sees it: its index, whether it can be
trusted now, and what went wrong.

Obeys the routing rules: pure code, no clock (``now`` is passed in), no I/O; the messages
come from the driver's subscriptions (``muxproxy/trio/kvevents.py``, ``trio/kvfollow.py``)
through the core (``core/upstream/kvfeeds.py``), which keeps a feed per server in the
group's router (``kvplace.py``). A message is vLLM's ``[topic, sequence, batch]``
(``ZmqEventPublisher``: the sequence is 8 bytes, big-endian, counting from 0 per publisher).

When the index is trusted (:meth:`EngineFeed.usable`): while the subscription is connected,
and, while the proxy has streams on the engine, only if a message came within
``stale_after`` seconds. An idle engine publishes nothing and stays trusted (its cache does
not change while idle); a busy one fills a block every ``block_size`` tokens, so silence
while busy means the publisher stopped. Untrusted, the router falls back to its approximate
prefix key. What is kept across a drop: the index. A reconnect does not replay what was
missed, so the index may name blocks evicted meanwhile (a request sent there finds a shorter
prefix than scored, never a wrong answer) until the engine removes or the cap forgets them;
clearing it instead would orphan every block the engine stores after a conversation's first
turn. A sequence gap (messages lost) is counted and logged the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from muxproxy.routing.kvindex import EngineBlocks, best_cached
from muxproxy.routing.kvwire import WireError, decode_batch

__all__ = ["EngineFeed", "place_by_cache"]


@attrs.define
class EngineFeed:
    """One engine's subscription state (see the module header)."""

    blocks: EngineBlocks
    stale_after: float = attrs.field(validator=attrs.validators.gt(0))
    topic: bytes = b"kv-events"

    connected: bool = attrs.field(default=False, init=False)
    last_at: float | None = attrs.field(default=None, init=False)
    """When the last message came (None: none yet)."""
    last_sequence: int | None = attrs.field(default=None, init=False)
    batches: int = attrs.field(default=0, init=False)
    gaps: int = attrs.field(default=0, init=False)
    """Times the sequence skipped ahead (messages lost) or went back (a publisher restarted)."""
    bad: int = attrs.field(default=0, init=False)
    """Messages that were not a ``[topic, sequence, batch]`` this module can read."""
    skipped_events: int = attrs.field(default=0, init=False)
    last_error: str | None = attrs.field(default=None, init=False)
    """What went wrong last: the subscription's failure, a refused message or a gap."""

    def up(self, now: float) -> None:
        """The subscription is connected."""
        self.connected = True
        self.last_at = now

    def down(self) -> None:
        """The subscription dropped."""
        self.connected = False

    def failed(self, reason: str) -> None:
        """The subscription failed, or could not be made: ``reason``, kept for ``/status``."""
        self.connected = False
        self.last_error = reason

    def message(self, parts: list[bytes], now: float) -> str | None:
        """Apply one message; returns why it was refused or what it revealed (to be logged),
        or None."""
        self.last_at = now
        if len(parts) != 3 or len(parts[1]) != 8 or not parts[0].startswith(self.topic):
            self.bad += 1
            self.last_error = f"a message of {len(parts)} frames is not [topic, sequence, batch]"
            return self.last_error
        sequence = int.from_bytes(parts[1], "big")
        try:
            batch = decode_batch(parts[2])
        except WireError as error:
            self.bad += 1
            self.last_error = f"an unreadable batch: {error}"
            return self.last_error
        note = None
        previous = self.last_sequence
        if previous is not None and sequence != previous + 1:
            self.gaps += 1
            note = f"sequence {sequence} after {previous}: events were lost or the engine restarted"
            self.last_error = note
        self.last_sequence = sequence
        self.batches += 1
        self.skipped_events += batch.skipped
        for event in batch.events:
            self.blocks.apply(event)
        return note

    def usable(self, now: float, busy: bool) -> bool:
        """Whether placement may trust the index now (``busy``: the proxy has streams there)."""
        if not self.connected:
            return False
        if not busy:
            return True
        return self.last_at is not None and now - self.last_at <= self.stale_after


def place_by_cache(
    ranked: Sequence[int],
    feeds: Mapping[int, EngineFeed],
    tokens: Sequence[int] | None,
    now: float,
    busy: Callable[[int], bool],
    within: Callable[[int], bool] | None = None,
) -> list[int]:
    """``ranked`` (the prefix key's bounded order) with the server whose trusted index holds
    the longest prefix of ``tokens`` moved to the front, within the load bounds (``within``,
    ``load.within_bounds``'s predicate); unchanged without tokens, or when no trusted index
    holds any of them: the prefix key's placement stands. A server without a feed, or whose
    feed is not trusted now (:meth:`EngineFeed.usable`; ``busy(i)``: the proxy has streams
    on ``i``), scores nothing."""
    if not tokens:
        return list(ranked)
    scores = []
    for index in ranked:
        feed = feeds.get(index)
        if feed is not None and feed.usable(now, busy(index)):
            scores.append((index, feed.blocks.cached_tokens(tokens)))
    return best_cached(ranked, scores, within)
