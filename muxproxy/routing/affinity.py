"""Session affinity memory: which server each session key was last sent to, and when.

Obeys the routing rules: pure code, standard library only (no trio, asyncio, socket, time,
random), no clock (``now`` is passed in), no I/O. Why it exists: weighted rendezvous hashing
moves a share of the keys whenever a weight changes, and a conversation moved mid-way loses
the KV cache its first server holds. Remembering where a key went lets an ongoing
conversation stay there while new keys follow the new weights.

Invariants:

- Bounded: at most ``limit`` keys (least recently sent first out) and none older than
  ``idle`` seconds survives a ``sent`` (expired keys are swept from the old end, a few per
  call, so no call does unbounded work).
- Keys are kept as their hash, never as sent: the memory holds no session identifiers, and
  each entry costs the same whatever the client sends. The hash (``key_hash``) is the first
  64 bits of the key's BLAKE2b (RFC 7693), the same in every process: the memory is shared
  with the other workers and replicas (``fleet/sessions.py``), which must find a key by the
  same number. Unsalted, a client can make two keys of its own collide (about 2**32 tries)
  but not one that lands on another client's key (a second preimage: 2**64), and a
  collision can only send one key to the other's server. Two keys with the same hash
  otherwise (about 1 in 10**9 pairs among 100,000 keys) share an entry alike.
- Memory learned from elsewhere (``learn``) follows "newest wins": an entry replaces the one
  held only if it was sent later, so entries that cross in flight settle the same way in
  every process; one older than ``idle`` is not taken.
- Sharing costs nothing unless asked for: with ``share`` set, each ``sent`` also calls it
  with the hash, the address and the time (the core batches them,
  ``core/exchange/sessionshare.py``).
- Servers are named by address, not by position: a reload that adds, removes or reorders
  servers keeps every entry meaningful, and one memory can serve the routers before and
  after it. A key of a server no longer in the group is ignored by the router and replaced
  on the key's next request.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["DEFAULT_LIMIT", "Affinity", "key_hash"]

DEFAULT_LIMIT = 100_000
"""Keys remembered per group. An entry costs about 200 bytes (an int key, a tuple of the
shared address string and a float, an ``OrderedDict`` slot and link; measured with
tracemalloc), so a full memory is about 20 MB: room for
100,000 conversations active within ``session_idle``, which is more than one proxy
process's backends serve at once."""

_SWEEP = 8
"""Expired entries dropped per ``sent`` at most: amortised O(1), never a long pause."""


def key_hash(key: bytes) -> int:
    """The hash a key is remembered by: the same for equal keys in every process."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest())


class Affinity:
    """An LRU map ``hash(key) -> (address, last sent)`` with a size bound and an idle time.

    An ``OrderedDict`` serves as the LRU list: ``sent`` moves its key to the end, so the
    first entry is always the least recently sent one. Not a plain dict: deleting from a
    dict's front leaves dummy slots that every later ``next(iter(...))`` walks again (until
    the dict is resized), which made each sweep O(n); an ``OrderedDict``'s ends are O(1).
    """

    __slots__ = ("_entries", "idle", "limit", "share")

    def __init__(self, idle: float, limit: int = DEFAULT_LIMIT) -> None:
        self.idle = idle
        """Seconds after its last request that a key is forgotten."""
        self.limit = limit
        self.share: Callable[[int, str, float], None] | None = None
        """Told of every ``sent`` (hash, address, time), to share it; None: not shared."""
        self._entries: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: bytes, now: float) -> str | None:
        """The address ``key`` was last sent to, if that was at most ``idle`` seconds ago."""
        entry = self._entries.get(key_hash(key))
        if entry is None or now - entry[1] > self.idle:
            return None
        return entry[0]

    def sent(self, key: bytes, address: str, now: float) -> None:
        """Remember that ``key`` was sent to ``address`` at ``now``."""
        digest = key_hash(key)
        self._remember(digest, address, now, now)
        if self.share is not None:
            self.share(digest, address, now)

    def learn(self, digest: int, address: str, at: float, now: float) -> bool:
        """Take an entry remembered elsewhere: the key of hash ``digest`` was sent to
        ``address`` at ``at``. True when taken: it is the newest known for the key and not
        older than ``idle``. An entry stamped after ``now`` (a peer whose clock is ahead, or a
        wrong one) counts as made ``now``: it could otherwise never expire, and would refuse
        every true update of its key until its time came."""
        at = min(at, now)
        if now - at > self.idle:
            return False
        held = self._entries.get(digest)
        if held is not None and held[1] >= at:
            return False
        self._remember(digest, address, at, now)
        return True

    def _remember(self, digest: int, address: str, at: float, now: float) -> None:
        entries = self._entries
        entries[digest] = (address, at)
        # Learned entries may be a little older than the newest: the front is then not
        # always the oldest, so a sweep may stop early; ``lookup`` checks the age anyway
        # and ``limit`` still bounds the size.
        entries.move_to_end(digest)
        oldest = entries[next(iter(entries))]
        if len(entries) > self.limit or now - oldest[1] > self.idle:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        entries = self._entries
        for _ in range(_SWEEP):
            oldest = next(iter(entries))
            if now - entries[oldest][1] <= self.idle and len(entries) <= self.limit:
                break
            entries.popitem(last=False)
