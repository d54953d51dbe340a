"""One runtime state for the fleet: the stored document, and what a replica does with one.

The operator's runtime state (weights, drain, down: :class:`~muxproxy.config.runtime.
RuntimeState`) is kept in the fleet store as one versioned document, so that every replica
(one ``muxproxy serve`` process, or the supervisor of ``--workers N``) applies the same one.
This module is the pure half: the document, its layout in Redis, the Lua scripts that change
it atomically, and the decision a replica takes when it reads or is sent one. The round trips,
the subscription and the clock are :mod:`muxproxy.trio.fleetstate`'s.

Layout. One hash, :data:`STATE_KEY`: ``version`` (an integer, +1 per change), ``lineage`` (a
random id given when the document is created: a store that lost everything and was seeded
again starts a new lineage, so versions of two lineages are never compared as if one),
``seeded`` (``1`` while the document is a replica's seed and no change was made on top of it)
and ``state`` (the state file's JSON, :meth:`RuntimeState.to_json`, kept as the client wrote
it: the scripts never parse it). Every write publishes the whole document as JSON on
:data:`CHANNEL`, so a replica applies a change without a read.

Rules, and why:

- **Compare and set** (:data:`CAS_SCRIPT`). A change is computed by the replica that took it,
  on the newest document it knows, and written only if the store still holds that version
  and lineage; otherwise the replica reads the store and computes it again. One script call
  writes the whole new state and publishes it: a step of several weights is one version,
  never seen half made.
- **Seeding** (:data:`SEED_SCRIPT`). A store with no document (an ephemeral Redis that was
  restarted) is never read as "no overrides": the replica that finds it empty writes its own
  last state with its own version, marked ``seeded``. Another replica whose version is higher
  writes its own over a seed (never over a change made since), so that with several replicas
  the seed that stays is the newest any of them had.
- **Decisions** (:func:`decide`). A replica applies a document of another lineage, or of a
  higher version; keeps what it has for the same or an older one (a message delivered after
  a read that already gave it); and seeds when the store is empty or holds a seed older than
  what it has.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

import attrs

from muxproxy.config.runtime import RuntimeState

__all__ = [
    "CAS_SCRIPT",
    "CHANNEL",
    "SEED_SCRIPT",
    "STATE_KEY",
    "FleetDocument",
    "Step",
    "StoreUnavailable",
    "cas_outcome",
    "decide",
    "document_from_hash",
    "document_from_message",
]

STATE_KEY = b"muxproxy:fleet:state"
"""The hash that holds the fleet's runtime state (see the module header)."""
CHANNEL = b"muxproxy:fleet:state:changes"
"""Where every write of :data:`STATE_KEY` is published, as the whole document."""
MAX_DOCUMENT = 4 * 1024 * 1024
"""Largest document read or received (bytes): a state of thousands of servers is a few
hundred KiB; anything near this is not ours, and parsing it would cost memory unbounded."""

CAS_SCRIPT = """
local current = redis.call('HMGET', KEYS[1], 'version', 'lineage')
if not current[1] then
  return {0, 0}
end
if current[1] ~= ARGV[1] or current[2] ~= ARGV[2] then
  return {-1, tonumber(current[1]) or 0}
end
local version = tonumber(current[1]) + 1
redis.call('HSET', KEYS[1], 'version', version, 'seeded', '0', 'state', ARGV[3])
redis.call('PUBLISH', ARGV[4], '{"version":' .. version .. ',"lineage":"' .. ARGV[2]
  .. '","seeded":false,"state":' .. ARGV[3] .. '}')
return {1, version}
"""
"""KEYS: the state hash. ARGV: the version and lineage the change was computed on, the new
state's JSON, the channel. Returns ``{1, new version}``; ``{0, 0}`` when the store holds no
document (seed it first); ``{-1, version held}`` when it holds another version or lineage."""

SEED_SCRIPT = """
local current = redis.call('HMGET', KEYS[1], 'version', 'seeded')
if current[1] and not (current[2] == '1' and tonumber(current[1]) < tonumber(ARGV[1])) then
  return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'lineage', ARGV[2], 'seeded', '1',
  'state', ARGV[3])
redis.call('PUBLISH', ARGV[4], '{"version":' .. ARGV[1] .. ',"lineage":"' .. ARGV[2]
  .. '","seeded":true,"state":' .. ARGV[3] .. '}')
return 1
"""
"""KEYS: the state hash. ARGV: the seeding replica's version, a new lineage, its state's
JSON, the channel. Writes when there is no document, or only a seed of a lower version;
returns 1 when it wrote, 0 when the store keeps what it has."""


@attrs.frozen(kw_only=True)
class FleetDocument:
    """A version of the fleet's runtime state, as stored, published or applied here."""

    version: int
    """+1 per change; a seed carries the version of the replica that wrote it."""
    lineage: str
    """Which history the version counts in ("" for a replica that never synced)."""
    seeded: bool = False
    """Written by a replica that found the store empty, and not changed since."""
    state: RuntimeState = attrs.field(factory=RuntimeState.empty)

    @classmethod
    def unsynced(cls, state: RuntimeState) -> FleetDocument:
        """What a replica holds before its first sync: its state file's state, version 0."""
        return cls(version=0, lineage="", state=state)

    def state_json(self) -> str:
        """The state as the scripts store it (compact JSON: it is published whole)."""
        return json.dumps(self.state.to_json(), separators=(",", ":"), sort_keys=True)


class StoreUnavailable(Exception):
    """A change refused because the store cannot take it now; the message says why (the
    admin API answers 503 with it)."""


class Step(enum.Enum):
    """What a replica does with a document it read or was sent (:func:`decide`)."""

    APPLY = "apply"
    """Make it the replica's state."""
    KEEP = "keep"
    """Nothing: the replica has it, or newer."""
    SEED = "seed"
    """Write the replica's own state to the store (:data:`SEED_SCRIPT`), then read again."""


def decide(held: FleetDocument, stored: FleetDocument | None) -> Step:
    """What a replica holding ``held`` does with ``stored`` (None: the store has none)."""
    if stored is None:
        return Step.SEED
    if stored.seeded and stored.version < held.version:
        # A replica that knew less seeded the store first: the newest state must win.
        return Step.SEED
    if stored.lineage != held.lineage or stored.version > held.version:
        return Step.APPLY
    return Step.KEEP


def cas_outcome(reply: Any) -> tuple[int, int]:
    """``(status, version)`` of a :data:`CAS_SCRIPT` reply; raises ``ValueError`` for another."""
    if (
        isinstance(reply, list | tuple)
        and len(reply) == 2
        and all(isinstance(item, int) and not isinstance(item, bool) for item in reply)
        and reply[0] in (-1, 0, 1)
    ):
        return reply[0], reply[1]
    raise ValueError(f"the compare-and-set script answered {reply!r}")


def document_from_hash(fields: Mapping[Any, Any]) -> FleetDocument | None:
    """The document of :data:`STATE_KEY`'s fields (``HGETALL``; names and values bytes or
    str); None for no fields at all. Raises ``ValueError`` naming the field at fault."""
    if not fields:
        return None
    text = {_text(name): _text(value) for name, value in fields.items()}
    missing = [name for name in ("version", "lineage", "seeded", "state") if name not in text]
    if missing:
        raise ValueError(f"{missing[0]}: missing from {STATE_KEY.decode()}")
    version = text["version"]
    if not version.isdigit() or len(version) > 18:
        raise ValueError(f"version: expected a non-negative integer, got {version[:40]!r}")
    if text["seeded"] not in ("0", "1"):
        raise ValueError(f"seeded: expected 0 or 1, got {text['seeded'][:40]!r}")
    return FleetDocument(
        version=int(version),
        lineage=_lineage(text["lineage"]),
        seeded=text["seeded"] == "1",
        state=_state(text["state"]),
    )


def document_from_message(data: bytes | str) -> FleetDocument:
    """The document a message on :data:`CHANNEL` carries; raises ``ValueError`` saying why."""
    if len(data) > MAX_DOCUMENT:
        raise ValueError(f"larger than {MAX_DOCUMENT} bytes")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(document, dict) or set(document) != {"version", "lineage", "seeded", "state"}:
        raise ValueError("expected an object with version, lineage, seeded and state")
    version, seeded = document["version"], document["seeded"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version: expected a non-negative integer, got {version!r}")
    if not isinstance(seeded, bool):
        raise ValueError(f"seeded: expected true or false, got {seeded!r}")
    lineage = document["lineage"]
    if not isinstance(lineage, str):
        raise ValueError(f"lineage: expected a string, got {lineage!r}")
    try:
        state = RuntimeState.from_json(document["state"])
    except ValueError as exc:
        raise ValueError(f"state: {exc}") from None
    return FleetDocument(version=version, lineage=_lineage(lineage), seeded=seeded, state=state)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _lineage(value: str) -> str:
    # Written by SEED_SCRIPT into JSON without escaping: only a hex id can be one.
    if not value or len(value) > 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"lineage: expected a hex id, got {value[:70]!r}")
    return value


def _state(text: str) -> RuntimeState:
    if len(text) > MAX_DOCUMENT:
        raise ValueError(f"state: larger than {MAX_DOCUMENT} bytes")
    try:
        return RuntimeState.from_json(json.loads(text))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"state: {exc}") from None
