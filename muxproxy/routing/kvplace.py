"""One group's placement by the engines' KV-cache events (``kv_events``): a feed per
server, the tokens of the conversations seen, and the one reordering it makes.

Obeys the routing rules: pure code, no clock (``now`` is passed in), no I/O. The driver
follows each engine's events (``trio/kvevents.py``) and asks the engines' ``/tokenize``
(``trio/kvfollow.py``); the core hands both in (``core/upstream/kvfeeds.py``).

The rule (:meth:`GroupKv.order`), applied to the prefix key's bounded order
(``load.bounded_order``) of a request with a conversation (``kvtokens.conversation_keys``):

- the tokens of its longest message prefix already tokenized are scored against every
  server's index (``kvfeed.place_by_cache``): the server holding the longest cached prefix
  goes first among those the prefix key's load rule allows (a free slot, or within
  ``load.within_bounds``, the same rule the prefix key obeys); a tie, or nothing held,
  keeps the prefix key's order;
- a server whose feed is not trusted now (not connected, or silent for ``stale_after``
  while it runs the proxy's streams: ``EngineFeed.usable``) scores nothing, so when every
  feed stops, every request is placed by the prefix key exactly as without ``kv_events``;
- a conversation's first turn (at most :data:`FIRST_TURN` messages, no tokens known) goes
  to the least loaded server while every feed is trusted: no engine can hold more of it
  than a shared system prompt, which each engine caches alike, so its history starts where
  there is room, and the events lead its later turns there; with a feed untrusted it keeps
  the prefix key's order, which its later turns would follow too;
- a later turn whose tokens are not known (an answer not back yet, forgotten) goes where
  its first turn went if load put that one off its key's server (remembered for
  :data:`FIRST_HOMES` first turns), else by the prefix key's order: tokens are never
  waited for. Every request's own messages are asked
  for (:meth:`GroupKv.ask`) for its next turn.

Bounds: the tokens of at most :data:`TOKEN_ENTRIES` prefixes and :data:`TOKEN_BUDGET`
tokens per group (least recently used forgotten), at most :data:`MAX_PENDING` tokenize
requests in flight per group (a request that finds them all taken asks nothing), and each
engine's index its ``max_blocks``.

What a new configuration keeps (:meth:`GroupKv.carry`): the feeds of the servers that stay,
the tokens and the requests in flight, while ``kv_events`` itself is unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import attrs

from muxproxy.config.kvevents import KvEvents
from muxproxy.routing.kvfeed import EngineFeed, place_by_cache
from muxproxy.routing.kvindex import EngineBlocks
from muxproxy.routing.kvtokens import TokenCache

__all__ = [
    "FIRST_HOMES",
    "FIRST_TURN",
    "MAX_PENDING",
    "TOKEN_BUDGET",
    "TOKEN_ENTRIES",
    "GroupKv",
    "least_loaded_first",
]

TOKEN_ENTRIES = 4096
"""Conversation prefixes whose tokens a group keeps: the conversations of the last minutes."""
TOKEN_BUDGET = 2_000_000
"""Tokens a group keeps, all prefixes together (some 16 MB of references, more for large
token ids): a few hundred long conversations."""
FIRST_TURN = 2
"""Messages of a conversation's first turn at most (a system prompt and the question): no
engine holds more of it than a shared system prompt, which every engine caches alike."""
FIRST_HOMES = 65_536
"""First turns a group remembers the server of, where load put one off its key's server
(some 6 MB at most): a later turn whose tokens are not known goes there."""
MAX_PENDING = 32
"""Tokenize requests in flight per group: a burst of new conversations asks for some and
places the rest by the prefix key, rather than queueing work on the engines."""


def _feed(settings: KvEvents) -> EngineFeed:
    return EngineFeed(
        EngineBlocks(settings.max_blocks),
        settings.stale_after,
        settings.topic.encode(),
    )


@attrs.define
class GroupKv:
    """The KV-event state of one group of ``size`` servers (see the module header)."""

    settings: KvEvents
    feeds: list[EngineFeed]
    """Per server, in the group's order."""
    tokens: TokenCache = attrs.field(factory=lambda: TokenCache(TOKEN_ENTRIES, TOKEN_BUDGET))
    pending: set[bytes] = attrs.field(factory=set)
    """Keys of the tokenize requests in flight."""
    placed: int = 0
    """Requests whose tokens were known when placed."""
    moved: int = 0
    """Of those, the ones the events put on another server than the prefix key's."""
    balanced: int = 0
    """First turns placed on the least loaded server, the feeds all trusted."""
    homes: OrderedDict[bytes, int] = attrs.field(factory=OrderedDict)
    """The server of each first turn load put off its key's (by the first turn's key),
    least recently used first; at most :data:`FIRST_HOMES`."""
    tokenize_failures: int = 0
    last_tokenize_error: str | None = None

    @classmethod
    def of(cls, settings: KvEvents, size: int) -> GroupKv:
        return cls(settings=settings, feeds=[_feed(settings) for _ in range(size)])

    def carry(self, old: GroupKv, moves: Iterable[tuple[int, int]]) -> None:
        """Take over ``old``'s feeds of the servers ``moves`` maps here (``(old index, new
        index)``), its tokens and its requests in flight, when the settings are the same."""
        if old.settings != self.settings:
            return
        moved = dict(moves)
        for before, after in moved.items():
            self.feeds[after] = old.feeds[before]
        self.homes = OrderedDict(
            (key, moved[index]) for key, index in old.homes.items() if index in moved
        )
        self.tokens, self.pending = old.tokens, old.pending
        self.placed, self.moved, self.balanced = old.placed, old.moved, old.balanced
        self.tokenize_failures = old.tokenize_failures
        self.last_tokenize_error = old.last_tokenize_error

    def order(
        self,
        ranked: list[int],
        conversation: Sequence[bytes],
        now: float,
        active: Sequence[int],
        weights: Sequence[int],
        within: Callable[[int], bool],
    ) -> list[int]:
        """``ranked`` (the prefix key's bounded order) with the server holding the longest
        cached prefix of the conversation's known tokens first, where ``within`` (the
        router's load rule: a free slot, or within the bounds) allows; a first turn on the
        least loaded server while every feed is trusted (see the module header)."""
        if len(ranked) < 2:
            return ranked
        known = self.tokens.longest(conversation)
        feeds = {index: self.feeds[index] for index in ranked}
        if known is None:
            if len(conversation) > FIRST_TURN:
                return self._first_turns_home(ranked, conversation, within)
            if not all(feed.usable(now, active[index] > 0) for index, feed in feeds.items()):
                return ranked  # untrusted: its key's server, where its later turns go too
            out = least_loaded_first(ranked, active, weights)
            if out[0] != ranked[0]:
                self.balanced += 1
                self.homes[conversation[-1]] = out[0]
                self.homes.move_to_end(conversation[-1])
                if len(self.homes) > FIRST_HOMES:
                    self.homes.popitem(last=False)
            return out
        self.placed += 1
        out = place_by_cache(ranked, feeds, known[1], now, lambda i: active[i] > 0, within)
        if out[0] != ranked[0]:
            self.moved += 1
        return out

    def _first_turns_home(
        self, ranked: list[int], conversation: Sequence[bytes], within: Callable[[int], bool]
    ) -> list[int]:
        """A later turn whose tokens are not known: the server its first turn went to, where
        load put it off its key's (and the load rule allows), else the key's order."""
        for key in conversation[:FIRST_TURN][::-1]:
            home = self.homes.get(key)
            if home is None:
                continue
            self.homes.move_to_end(key)
            if home in ranked and home != ranked[0] and within(home):
                out = list(ranked)
                out.insert(0, out.pop(out.index(home)))
                return out
            break
        return ranked

    def ask(self, conversation: Sequence[bytes]) -> bytes | None:
        """The key to tokenize for this conversation's next turn (its whole prompt), now
        counted in flight; None when it is known, asked already, or too many are in flight."""
        if not self.tokens.wanted(conversation):
            return None
        key = conversation[-1]
        if key in self.pending or len(self.pending) >= MAX_PENDING:
            return None
        self.pending.add(key)
        return key

    def answered(self, key: bytes, tokens: tuple[int, ...] | None, error: str) -> bool:
        """A tokenize answer (None: it failed, ``error`` says why); True when it changes
        whether the last one failed (to be logged)."""
        self.pending.discard(key)
        failed_before = self.last_tokenize_error is not None
        if tokens is None:
            self.tokenize_failures += 1
            self.last_tokenize_error = error
            return not failed_before
        self.tokens.put(key, tokens)
        self.last_tokenize_error = None
        return failed_before

    def status(self, index: int, now: float, busy: bool) -> dict[str, object]:
        """Server ``index``'s feed for ``/status``."""
        feed = self.feeds[index]
        return {
            "connected": feed.connected,
            "trusted": feed.usable(now, busy),
            "blocks": len(feed.blocks),
            "batches": feed.batches,
            "gaps": feed.gaps,
            "bad": feed.bad,
            "orphans": feed.blocks.orphans,
            "last_error": feed.last_error,
            "age": None if feed.last_at is None else round(now - feed.last_at, 3),
        }

    def group_status(self) -> dict[str, object]:
        """The group's side for ``/status``: tokens known, placements, tokenize failures."""
        return {
            "conversations": len(self.tokens),
            "tokens": self.tokens.tokens,
            "tokenizing": len(self.pending),
            "placed": self.placed,
            "moved": self.moved,
            "balanced": self.balanced,
            "first_homes": len(self.homes),
            "tokenize_failures": self.tokenize_failures,
            "last_tokenize_error": self.last_tokenize_error,
        }


def least_loaded_first(
    ranked: list[int], active: Sequence[int], weights: Sequence[int]
) -> list[int]:
    """``ranked`` with the server of the fewest streams per weight first (a tie keeps the
    ranking's order: the key's own server wins it)."""
    best = min(range(len(ranked)), key=lambda at: active[ranked[at]] / max(weights[ranked[at]], 1))
    if best == 0:
        return ranked
    out = list(ranked)
    out.insert(0, out.pop(best))
    return out
