"""The memory of recent sessions, shared by the workers of a host and the replicas of a fleet.

Each process remembers where a session key was last sent (``routing/affinity.py``), so that a
conversation's next turn goes back to the server holding its KV cache even after a weight
change moved the key's hash elsewhere. A turn that lands on another worker or replica must
find that memory there too: this module is what they exchange, as pure code (no Trio, no
socket, no clock: times come in as arguments).

Theory of operation:

- **What is shared** is a :class:`SessionEntry`: the group, the key's hash (64 bits,
  ``affinity.key_hash``: never the key itself), the server's address and when the key was
  sent there. Wall-clock seconds (POSIX) between processes; each process turns them into its
  own monotonic clock at the edge (the driver), so the core keeps one clock.
- **Newest wins.** An entry replaces what a process holds for the key only if it is later
  (``Affinity.learn``, :meth:`SessionMemory.learn`): entries that cross in flight settle
  the same way everywhere, whatever order they arrive in. An entry older than the group's
  ``sticky.session_idle`` is dropped wherever it is found.
- **Batched.** The core collects what it remembers in an :class:`Outbox` and hands it out at
  most every :data:`SHARE_DELAY` seconds as one command (the latest entry per key only), so
  sharing adds no system call to a request and nothing at all to the token path.
- **Bounded.** An outbox holds at most :data:`OUTBOX_LIMIT` keys (past it, the batch goes
  out at once); a :class:`SessionMemory` at most ``limit`` keys per group, least recently
  sent first out; a message at most :data:`MESSAGE_LIMIT` entries.
- **Nothing read is trusted.** :func:`entries_from_wire` checks every field of what comes
  from a peer or the store (types, sizes, finite times, hashes in 64 bits) and reports what
  it refused instead of raising: a bad entry is dropped, never applied.

A supervisor of workers (``muxproxy serve --workers N``) holds a :class:`SessionMemory` of
the host: what it relays to the workers, and what it hands a worker that starts later. The
store's side (Redis) is ``muxproxy.trio.fleetsessions``.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

__all__ = [
    "MESSAGE_LIMIT",
    "OUTBOX_LIMIT",
    "SHARE_DELAY",
    "Outbox",
    "SessionEntry",
    "SessionMemory",
    "entries_from_wire",
    "entries_to_wire",
    "message_from_wire",
    "stored_item",
]

SHARE_DELAY = 0.05
"""Seconds from the first entry remembered to the batch that shares it: a conversation's next
turn comes seconds later, and 20 batches a second cost nothing next to the requests."""
OUTBOX_LIMIT = 4096
"""Keys one batch holds; one more sends the batch at once (a burst of new sessions)."""
MESSAGE_LIMIT = 4096
"""Entries one message carries at most; a longer list is split (``chunks``)."""
MAX_GROUP = 256
"""Longest group name taken from a peer (configured names are far shorter)."""
MAX_ADDRESS = 512
"""Longest server address taken from a peer (a host name of 253 and a port fit)."""
MAX_MESSAGE = 4 * 1024 * 1024
"""Largest published message read (bytes): :data:`MESSAGE_LIMIT` entries of the longest
names fit; parsing anything larger would cost memory unbounded."""
_KEY_LIMIT = 1 << 64


@attrs.frozen(kw_only=True, slots=True)
class SessionEntry:
    """One remembered session: the key of hash ``key`` in ``group`` went to ``address`` at
    ``at``."""

    group: str
    """The upstream group's configured name."""
    key: int
    """``affinity.key_hash`` of the session key: 0 <= key < 2**64."""
    address: str
    """The server's configured address (``host:port``)."""
    at: float
    """When it was sent there: the core's monotonic clock inside a process, wall-clock
    (POSIX) seconds between processes."""


class Outbox:
    """What a core remembered since its last batch: the latest entry per (group, key)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, group: str, key: int, address: str, at: float) -> bool:
        """Queue an entry (replacing the key's earlier one); True when the batch is full."""
        self._entries[group, key] = (address, at)
        return len(self._entries) >= OUTBOX_LIMIT

    def take(self) -> tuple[SessionEntry, ...]:
        """Every queued entry, oldest first; the outbox is empty after."""
        entries = self._entries
        self._entries = {}
        out = [
            SessionEntry(group=group, key=key, address=address, at=at)
            for (group, key), (address, at) in entries.items()
        ]
        out.sort(key=lambda entry: entry.at)
        return tuple(out)


class SessionMemory:
    """The sessions of every group, newest per key, for a process that does not route (the
    supervisor of workers): what it relays and what it hands a worker that starts later.

    Times are wall-clock seconds. ``idle`` maps a group to its ``sticky.session_idle``; a
    group not in it is not remembered (a peer's group this configuration lacks)."""

    __slots__ = ("_groups", "idle", "limit")

    def __init__(self, idle: Mapping[str, float], limit: int) -> None:
        self.idle = dict(idle)
        self.limit = limit
        self._groups: dict[str, OrderedDict[int, tuple[str, float]]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._groups.values())

    def reconfigure(self, idle: Mapping[str, float]) -> None:
        """A new configuration: its groups' idle times; removed groups are forgotten."""
        self.idle = dict(idle)
        for name in [name for name in self._groups if name not in self.idle]:
            del self._groups[name]

    def learn(self, entries: Iterable[SessionEntry], now: float) -> list[SessionEntry]:
        """Take ``entries`` (newest wins, none older than its group's idle time); returns
        those taken, which are the ones worth passing on."""
        taken = []
        for entry in entries:
            idle = self.idle.get(entry.group)
            if idle is None or now - entry.at > idle:
                continue
            group = self._groups.get(entry.group)
            if group is None:
                group = self._groups[entry.group] = OrderedDict()
            held = group.get(entry.key)
            if held is not None and held[1] >= entry.at:
                continue
            group[entry.key] = (entry.address, entry.at)
            group.move_to_end(entry.key)
            while len(group) > self.limit:
                group.popitem(last=False)
            taken.append(entry)
        return taken

    def live(self, now: float) -> list[SessionEntry]:
        """Every entry not older than its group's idle time (the expired ones are dropped)."""
        out: list[SessionEntry] = []
        for name, group in self._groups.items():
            idle = self.idle.get(name, 0.0)
            for key in [k for k, (_, at) in group.items() if now - at > idle]:
                del group[key]
            out.extend(
                SessionEntry(group=name, key=key, address=address, at=at)
                for key, (address, at) in group.items()
            )
        return out


def entries_to_wire(entries: Iterable[SessionEntry]) -> list[list[Any]]:
    """``entries`` as JSON-able lists ``[group, key as 16 hex digits, address, at]``: JSON
    numbers lose integers above 2**53, so the hash travels as text."""
    return [[e.group, f"{e.key:016x}", e.address, e.at] for e in entries]


def entries_from_wire(items: object) -> tuple[list[SessionEntry], int]:
    """The entries of a message (``entries_to_wire``'s form), and how many were refused
    (not a list of the four checked fields). Never raises."""
    if not isinstance(items, list):
        return [], 1
    entries = []
    refused = 0
    for item in items[:MESSAGE_LIMIT]:
        entry = _entry_of(item)
        if entry is None:
            refused += 1
        else:
            entries.append(entry)
    return entries, refused + max(0, len(items) - MESSAGE_LIMIT)


def _entry_of(item: object) -> SessionEntry | None:
    if not isinstance(item, list) or len(item) != 4:
        return None
    group, key, address, at = item
    if not (isinstance(group, str) and 0 < len(group) <= MAX_GROUP):
        return None
    if not (isinstance(address, str) and 0 < len(address) <= MAX_ADDRESS):
        return None
    if not (isinstance(key, str) and len(key) == 16):
        return None
    try:
        number = int(key, 16)
    except ValueError:
        return None
    if not 0 <= number < _KEY_LIMIT:
        return None
    if isinstance(at, bool) or not isinstance(at, int | float):
        return None
    try:
        seconds = float(at)
    except OverflowError:  # an integer (JSON has no bound on them) past every float
        return None
    if not math.isfinite(seconds):
        return None
    return SessionEntry(group=group, key=number, address=address, at=seconds)


def message_from_wire(data: object) -> tuple[object, list[SessionEntry], int]:
    """A published batch, ``{"origin": ..., "entries": [...]}`` (``entries_to_wire``'s
    form): its origin (None when it names none), its entries, and how many were refused.
    Raises ``ValueError`` saying why for what is no such message: not bytes or text, larger
    than :data:`MAX_MESSAGE`, not JSON (or nested too deep to parse), not an object."""
    if not isinstance(data, bytes | str):
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"larger than {MAX_MESSAGE} bytes")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc})"[:200]) from None
    if not isinstance(body, dict):
        raise ValueError(f"expected an object, got {type(body).__name__}")
    entries, refused = entries_from_wire(body.get("entries"))
    return body.get("origin"), entries, refused


def stored_item(group: str, field: bytes | str, value: bytes | str) -> list[Any] | None:
    """A field and value of a group's hash in the store (the key's 16 hex digits; the time
    and the address, space-separated) as ``entries_from_wire`` takes it; None for one that
    is not text or has no number where the time goes."""
    try:
        key = field.decode() if isinstance(field, bytes) else field
        text = value.decode() if isinstance(value, bytes) else value
        at, _, address = text.partition(" ")
        return [group, key, address, float(at)]
    except (UnicodeDecodeError, ValueError):
        return None


def chunks(entries: list[SessionEntry]) -> Iterator[list[SessionEntry]]:
    """``entries`` in lists of at most :data:`MESSAGE_LIMIT`."""
    for start in range(0, len(entries), MESSAGE_LIMIT):
        yield entries[start : start + MESSAGE_LIMIT]
