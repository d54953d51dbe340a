"""The fleet's fuzz cases: what the store (Redis) returns, and what DNS answers over time.

``check_store(buf)`` (target ``fleet_store``): byte 0 picks a parser of what the store sends,
the rest is what it sent, read by :class:`Reader` into the shape the client library gives
(a hash of byte fields, a published message, a script's reply of nested integers, bytes,
text). Each parser returns a valid value or raises its documented error, and nothing else:

- ``state.document_from_hash`` (``HGETALL`` of the state): a ``FleetDocument`` or None, or
  ``ValueError``; a document returned is the one the compare-and-set script would publish
  for the same fields (``document_from_message`` reads it back equal), and its state is the
  one its own JSON gives;
- ``state.document_from_message`` (the published state): as above;
- ``sessions.message_from_wire`` (a published batch of sessions) and ``sessions.stored_item``
  then ``entries_from_wire`` (the hash ``HSCAN`` reads): entries with every field in bounds,
  or ``ValueError`` for the message, never for an entry;
- ``budgets.read_reply`` (the reservation script): a ``Verdict`` in bounds, or ``BadReply``;
  a refusal of any verdict makes the 429's headers without raising;
- ``budgets.replicas_of`` (the announcement script): a count >= 1, or ``BadReply``;
- ``state.cas_outcome`` (the compare-and-set script): a status in (-1, 0, 1), or ``ValueError``.

``check_discovery(buf)`` (target ``discovery``): the bytes are a group's ``interval`` and a
sequence of lookups, each after some seconds: an A/AAAA answer, an SRV answer (priorities,
weights, ports, targets and their addresses), one without records, or a failure; every one
with a TTL. Each goes through the same conversion as ``trio/discovery.py`` and through
``fleet.discovery.decide``; the new set becomes the group's servers (``with_discovered``) in
a live ``ProxyCore`` (``ConfigChanged``) and a request is routed over it. Invariants: a
failure or an empty answer changes nothing and counts a failure; the set never empties but
by an answer; the next lookup is within [1 s, interval] of now (backing off after failures);
members are the answer's unique addresses, in order, and a kept server keeps its join time;
the change names exactly the addresses that joined and left; every request ends (``harness.
check_endings``).

Only the standard library, h11 and muxproxy (the smoke test replays the corpus without
atheris).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import attrs

from muxproxy.config import Route, quick_config
from muxproxy.config.discovery import Discover
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.events import ConfigChanged
from muxproxy.core.proxy import ProxyCore
from muxproxy.fleet import budgets, sessions, state
from muxproxy.fleet.discovery import (
    MIN_INTERVAL,
    Answer,
    Failure,
    Known,
    LookupResult,
    Target,
    decide,
    host_port,
    srv_targets,
    with_discovered,
)
from muxproxy.routing.ratelimit import Budget
from muxproxy.testing.simdriver import SimDriver

from .harness import check_endings

STORE_PARSERS = ("hash", "state_message", "sessions_message", "sessions_hash", "reserve",
                 "announce", "cas")  # fmt: skip
"""``check_store``'s parsers, by byte 0 (modulo their number)."""


class Reader:
    """Fuzz bytes read as values; past the end every read gives zeros (or nothing)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def __bool__(self) -> bool:
        return self.at < len(self.data)

    def take(self, n: int) -> bytes:
        out = self.data[self.at : self.at + n]
        self.at += len(out)
        return out

    def byte(self) -> int:
        return self.take(1)[0] if self else 0

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size).ljust(size, b"\0"), "big")

    def rest(self) -> bytes:
        return self.take(len(self.data))

    def value(self, depth: int = 0) -> Any:
        """A reply as a client library gives it: integers (some past 64 bits), bytes, text
        (some of it a number), floats, None, booleans, lists."""
        tag = self.byte() % 9
        if tag == 0:
            return self.uint(2) - 2**15
        if tag == 1:
            size = self.byte() % 64
            return int.from_bytes(self.take(size), "big", signed=True)
        if tag == 2:
            return self.take(self.byte() % 32)
        if tag == 3:
            return self.take(self.byte() % 32).decode("latin-1")
        if tag == 4:
            return struct.unpack(">d", self.take(8).ljust(8, b"\0"))[0]
        if tag == 5 and depth < 4:
            return [self.value(depth + 1) for _ in range(self.byte() % 8)]
        if tag == 6:
            return None
        if tag == 7:
            return bool(self.byte() & 1)
        return repr(self.uint(4) / (1 + self.byte())).encode()


# -- the store ---------------------------------------------------------------------------

HASH_FIELDS = (b"version", b"lineage", b"seeded", b"state")


def check_store(buf: bytes) -> None:
    """The ``fleet_store`` target (see the module docstring)."""
    if not buf:
        return
    parser = STORE_PARSERS[buf[0] % len(STORE_PARSERS)]
    reader = Reader(buf[1:])
    if parser == "hash":
        _check_hash(reader)
    elif parser == "state_message":
        raw = reader.rest()
        for data in (raw, raw.decode("utf-8", "replace")):
            try:
                document = state.document_from_message(data)
            except ValueError:
                continue
            _check_document(document)
    elif parser == "sessions_message":
        try:
            _origin, entries, refused = sessions.message_from_wire(reader.rest())
        except ValueError:
            return
        _check_entries(entries, refused)
    elif parser == "sessions_hash":
        items = []
        while reader:
            field, value = reader.take(reader.byte() % 24), reader.take(reader.byte() % 48)
            item = sessions.stored_item("g", field, value)
            if item is not None:
                assert isinstance(item[3], float) and item[0] == "g", item
                items.append(item)
        _check_entries(*sessions.entries_from_wire(items))
    elif parser == "reserve":
        _check_reserve(reader.value())
    elif parser == "announce":
        reply = reader.value()
        try:
            count = budgets.replicas_of(reply)
        except budgets.BadReply:
            return
        assert type(count) is int and 1 <= count <= budgets.MAX_NUMBER, (reply, count)
    else:
        reply = reader.value()
        try:
            status, version = state.cas_outcome(reply)
        except ValueError:
            return
        assert status in (-1, 0, 1) and type(version) is int, reply


def _check_hash(reader: Reader) -> None:
    fields: dict[bytes | str, bytes | str] = {}
    for _ in range(reader.byte() % 8):
        pick = reader.byte()
        name: bytes | str = HASH_FIELDS[pick % 4] if pick < 192 else reader.take(pick % 8)
        value: bytes | str = reader.take(reader.uint(2) % 1024)
        if pick & 0x10:  # a client that decodes its replies
            name = name.decode("latin-1") if isinstance(name, bytes) else name
            value = value.decode("latin-1") if isinstance(value, bytes) else value
        fields[name] = value
    try:
        document = state.document_from_hash(fields)
    except ValueError:
        return
    if document is None:
        assert not fields
        return
    _check_document(document)
    # What CAS_SCRIPT publishes from these fields (the state's JSON verbatim) is the same
    # document: a replica that reads the hash and one that gets the message agree.
    text = {_text(k): _text(v) for k, v in fields.items()}
    seeded = "true" if document.seeded else "false"
    message = (
        f'{{"version":{document.version},"lineage":"{text["lineage"]}",'
        f'"seeded":{seeded},"state":{text["state"]}}}'
    )
    assert state.document_from_message(message) == document, message


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _check_document(document: state.FleetDocument) -> None:
    assert type(document.version) is int and document.version >= 0, document
    lineage = document.lineage
    assert 0 < len(lineage) <= 64 and set(lineage) <= set("0123456789abcdef"), document
    assert isinstance(document.seeded, bool), document
    assert RuntimeState.from_json(document.state.to_json()) == document.state, document
    json.dumps(document.state_json())  # what a replica writes back is JSON


def _check_entries(entries: list[sessions.SessionEntry], refused: int) -> None:
    assert refused >= 0 and len(entries) <= sessions.MESSAGE_LIMIT
    for entry in entries:
        assert isinstance(entry.group, str) and 0 < len(entry.group) <= sessions.MAX_GROUP
        assert isinstance(entry.address, str) and 0 < len(entry.address) <= sessions.MAX_ADDRESS
        assert type(entry.key) is int and 0 <= entry.key < 2**64, entry
        assert type(entry.at) is float and math.isfinite(entry.at), entry
    # What a process passes on is read back the same.
    again = sessions.entries_from_wire(json.loads(json.dumps(sessions.entries_to_wire(entries))))
    assert again == (entries, 0), again


BUDGETS = (
    Budget(tokens_per_minute=10_000, requests_per_minute=100, max_concurrent=2),
    Budget(tokens_per_minute=1),
    Budget(requests_per_minute=1, max_concurrent=1),
)


def _check_reserve(reply: object) -> None:
    try:
        verdict = budgets.read_reply(reply)
    except budgets.BadReply:
        return
    assert 0 <= int(verdict.short) < 16 and verdict.held >= 0, verdict
    for number in (verdict.wait, verdict.tokens, verdict.requests):
        assert math.isfinite(number) and abs(number) <= budgets.MAX_NUMBER, verdict
    assert verdict.wait >= 0, verdict
    if verdict.reserved:
        return
    for budget in BUDGETS:
        refusal = budgets.refusal_of(verdict, budget, 50)
        assert math.isfinite(refusal.retry_after) and refusal.retry_after >= 0, refusal
        for name, value in refusal.headers:
            assert isinstance(name, bytes) and isinstance(value, bytes) and len(value) < 64


# -- discovery ---------------------------------------------------------------------------

SRV_NAMES = ("a.svc.", "b.svc.", "c.svc.", ".")
"""SRV targets a case picks from (``.`` is RFC 2782's "no service here")."""
GROUP = "gpus"


def _host(reader: Reader) -> str:
    if reader.byte() & 1:
        return f"2001:db8::{reader.uint(2):x}"
    return f"10.0.{reader.byte() % 4}.{reader.byte() % 8}"


def lookup_of(reader: Reader, discover: Discover) -> Answer | Failure:
    """One lookup's outcome, as ``trio/discovery.py::lookup`` makes it from what DNS said."""
    kind = reader.byte() % 5
    ttl = reader.uint(4)
    if kind == 0:
        results = [r for r in LookupResult if r is not LookupResult.OK]
        return Failure(result=results[reader.byte() % len(results)], reason="fuzzed")
    if kind == 1:
        return Answer(targets=(), ttl=ttl)
    if kind == 2:
        assert discover.port is not None
        hosts = [_host(reader) for _ in range(reader.byte() % 12)]
        name = discover.name
        targets = tuple(Target(address=host_port(h, discover.port), name=name) for h in hosts)
        return Answer(targets=targets, ttl=ttl)
    records = []
    for _ in range(reader.byte() % 8):
        priority, weight, port = reader.uint(2), reader.uint(2), reader.uint(2)
        records.append((priority, weight, port, SRV_NAMES[reader.byte() % len(SRV_NAMES)]))
    records = [r for r in records if r[2]]  # as ``_srv``: a port of 0 names no server
    addresses = {name: [_host(reader) for _ in range(reader.byte() % 4)] for name in SRV_NAMES}
    return Answer(targets=srv_targets(records, addresses), ttl=ttl)


def check_discovery(buf: bytes) -> None:
    """The ``discovery`` target (see the module docstring)."""
    reader = Reader(buf)
    interval = float(1 + reader.byte() % 60)
    discover = Discover(dns="vllm.svc.", port=8000, interval=interval, weight=2)
    config = quick_config("127.0.0.1:8080", ["127.0.0.1:9"])
    group = attrs.evolve(
        config.upstreams["default"], name=GROUP, servers=(), discover=discover, slow_start=30.0
    )
    route = Route(prefix="/", upstream=GROUP)
    config = attrs.evolve(config, upstreams={GROUP: group}, routes=(route,))
    core = ProxyCore(config, raise_errors=True)
    driver = SimDriver(core, answer_backends=True)
    known, now, client = Known(), 0.0, 1
    for _ in range(16):
        if not reader:
            break
        now += reader.byte() / 4
        outcome = lookup_of(reader, discover)
        decision = decide(known, outcome, now, interval)
        _check_decision(known, outcome, decision, now, interval)
        known = decision.known
        if decision.change and known.last_success is not None:
            # What the server does with a new set (``ProxyServer.apply_discovered``).
            config = with_discovered(config, {GROUP: known.targets})
            servers = config.upstreams[GROUP].servers
            assert [s.address for s in servers] == [m.target.address for m in known.members]
            driver.now = max(driver.now, now)
            driver.feed(ConfigChanged(now=driver.now, config=config))
            driver.settle()
        if reader.byte() & 1:
            driver.accept(client)
            driver.deliver(client, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            client += 1
    driver.fire_timers()
    driver.close_everything()
    driver.fire_timers()
    check_endings(driver)


def _check_decision(
    known: Known, outcome: Answer | Failure, decision: Any, now: float, interval: float
) -> None:
    new = decision.known
    wait = decision.next_lookup - now
    assert MIN_INTERVAL <= wait <= max(interval, MIN_INTERVAL), (wait, interval)
    if isinstance(outcome, Failure) or not outcome.targets:
        assert new.members == known.members, "a failure or an empty answer changed the set"
        assert not decision.change and new.failures == known.failures + 1
        assert new.last_success == known.last_success and new.last_error_at == now
        assert decision.result is not LookupResult.OK
        # Backing off: never sooner than the last wait after a failure in a row.
        expected = min(interval, MIN_INTERVAL * 2 ** min(new.failures - 1, 16))
        assert wait == max(expected, MIN_INTERVAL), (wait, new.failures)
        return
    assert decision.result is LookupResult.OK and new.failures == 0 and new.last_success == now
    unique = list(dict.fromkeys(t.address for t in outcome.targets))
    addresses = [m.target.address for m in new.members]
    assert addresses == sorted(unique), "the set is not the answer's addresses, in order"
    assert new.members, "a non-empty answer gave no servers"
    before = {m.target.address: m for m in known.members}
    for member in new.members:
        old = before.get(member.target.address)
        assert member.joined == (now if old is None else old.joined), member
        first = next(t for t in outcome.targets if t.address == member.target.address)
        assert member.target == first, "a target named twice keeps the first record"
    assert set(decision.change.joined) == set(addresses) - set(before)
    assert set(decision.change.left) == set(before) - set(addresses)
    ttl = outcome.ttl
    expected = interval if ttl is None else min(interval, ttl)
    assert wait == max(expected, MIN_INTERVAL), (wait, ttl)
