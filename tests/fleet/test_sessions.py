"""What the workers and replicas exchange of the memory of sessions (``fleet/sessions.py``):
the outbox keeps the latest entry per key, the host's memory takes the newest and forgets the
expired, and what comes from a peer is checked field by field, never trusted."""

from __future__ import annotations

import hashlib
import json

import pytest

from muxproxy.fleet.sessions import (
    MESSAGE_LIMIT,
    OUTBOX_LIMIT,
    Outbox,
    SessionEntry,
    SessionMemory,
    chunks,
    entries_from_wire,
    entries_to_wire,
    message_from_wire,
    stored_item,
)
from muxproxy.routing.affinity import Affinity, key_hash


def entry(
    key: int, address: str = "10.0.0.1:8000", at: float = 100.0, group: str = "g"
) -> SessionEntry:
    return SessionEntry(group=group, key=key, address=address, at=at)


def test_outbox_keeps_the_latest_entry_per_key_oldest_first() -> None:
    outbox = Outbox()
    assert not outbox.add("g", 1, "a:1", 5.0)
    outbox.add("g", 2, "b:1", 3.0)
    outbox.add("g", 1, "c:1", 7.0)
    outbox.add("h", 1, "d:1", 1.0)
    assert outbox.take() == (
        entry(1, "d:1", 1.0, "h"),
        entry(2, "b:1", 3.0),
        entry(1, "c:1", 7.0),
    )
    assert len(outbox) == 0 and outbox.take() == ()


def test_outbox_says_when_a_batch_is_full() -> None:
    outbox = Outbox()
    full = [outbox.add("g", n, "a:1", 0.0) for n in range(OUTBOX_LIMIT)]
    assert full == [False] * (OUTBOX_LIMIT - 1) + [True]


def test_memory_takes_the_newest_and_returns_what_it_took() -> None:
    memory = SessionMemory({"g": 60.0}, limit=10)
    assert memory.learn([entry(1, at=100.0)], now=100.0) == [entry(1, at=100.0)]
    assert memory.learn([entry(1, "x:1", at=99.0)], now=100.0) == []  # older: not taken
    assert memory.learn([entry(1, "y:1", at=100.0)], now=100.0) == []  # not newer
    newer = entry(1, "z:1", at=101.0)
    assert memory.learn([newer], now=101.0) == [newer]
    assert memory.live(101.0) == [newer]


def test_memory_forgets_expired_entries_and_groups_it_does_not_know() -> None:
    memory = SessionMemory({"g": 60.0}, limit=10)
    assert memory.learn([entry(1, at=10.0)], now=100.0) == []  # 90 s old: expired already
    assert memory.learn([entry(2, group="other")], now=100.0) == []
    memory.learn([entry(3, at=50.0), entry(4, at=90.0)], now=90.0)
    assert memory.live(111.0) == [entry(4, at=90.0)]
    memory.reconfigure({"h": 60.0})
    assert len(memory) == 0


def test_memory_is_bounded_least_recently_sent_first_out() -> None:
    memory = SessionMemory({"g": 600.0}, limit=3)
    memory.learn([entry(n, at=float(n)) for n in range(5)], now=5.0)
    assert sorted(e.key for e in memory.live(5.0)) == [2, 3, 4]


def test_wire_round_trip_keeps_64_bit_hashes_exact() -> None:
    entries = [entry(2**64 - 1, at=1.5), entry(0, "[::1]:8000", at=1e9)]
    wire = json.loads(json.dumps(entries_to_wire(entries)))
    assert entries_from_wire(wire) == (entries, 0)


@pytest.mark.parametrize(
    "bad",
    [
        "not a list item",
        ["g", "00000000000000zz", "a:1", 1.0],  # not hex
        ["g", "1", "a:1", 1.0],  # not 16 digits
        ["g", "0000000000000001", "a:1", float("nan")],
        ["g", "0000000000000001", "a:1", True],
        ["g", "0000000000000001", "a:1", 10**400],  # JSON integers have no bound
        ["g", "0000000000000001", "", 1.0],
        ["", "0000000000000001", "a:1", 1.0],
        ["g" * 300, "0000000000000001", "a:1", 1.0],
        ["g", "0000000000000001", "a:1"],
        [1, "0000000000000001", "a:1", 1.0],
    ],
)
def test_a_bad_entry_from_a_peer_is_refused_and_counted_never_raised(bad: object) -> None:
    good = ["g", "0000000000000001", "a:1", 1.0]
    assert entries_from_wire([good, bad]) == ([entry(1, "a:1", 1.0)], 1)


@pytest.mark.parametrize(
    "data",
    [b"[" * 100_000, b"\xff", b"[]", b"1e999", "{", 7, None],
    ids=["nested-too-deep", "not-utf8", "a-list", "a-number", "cut", "an-int", "none"],
)
def test_a_published_message_that_is_no_batch_raises_value_error(data: object) -> None:
    with pytest.raises(ValueError):
        message_from_wire(data)


def test_a_published_batch_gives_its_origin_entries_and_refusals() -> None:
    wire = entries_to_wire([entry(5)])
    data = json.dumps({"origin": "o", "entries": [*wire, ["g", "x"]]}).encode()
    assert message_from_wire(data) == ("o", [entry(5)], 1)
    assert message_from_wire(b"{}") == (None, [], 1)


@pytest.mark.parametrize(
    ("field", "value", "item"),
    [
        (b"0000000000000001", b"12.5 a:1", ["g", "0000000000000001", "a:1", 12.5]),
        (b"0000000000000001", b"x 10.0.0.1:8000", None),
        (b"\xff", b"1 a:1", None),
        ("0000000000000001", "1e999", ["g", "0000000000000001", "", float("inf")]),
    ],
)  # fmt: skip
def test_a_stored_field_is_read_as_a_wire_item_or_none(
    field: bytes | str, value: bytes | str, item: list[object] | None
) -> None:
    assert stored_item("g", field, value) == item
    if item is not None and item[3] == float("inf"):
        assert entries_from_wire([item]) == ([], 1)  # no infinite time is taken


def test_a_message_that_is_not_a_list_or_too_long_is_cut() -> None:
    assert entries_from_wire({"entries": []}) == ([], 1)
    many = entries_to_wire([entry(n) for n in range(MESSAGE_LIMIT + 3)])
    taken, refused = entries_from_wire(many)
    assert len(taken) == MESSAGE_LIMIT and refused == 3
    assert [len(part) for part in chunks([entry(n) for n in range(MESSAGE_LIMIT + 1)])] == [
        MESSAGE_LIMIT,
        1,
    ]


def test_an_entry_from_the_future_counts_as_made_now() -> None:
    memory = Affinity(idle=60.0)
    digest = key_hash(b"chat-1")
    assert memory.learn(digest, "a:1", 1e12, now=100.0)  # a clock far ahead, or a bad peer
    assert memory.lookup(b"chat-1", 150.0) == "a:1"
    # A true update from another replica a moment later wins...
    assert memory.learn(digest, "b:1", 101.0, now=101.0)
    assert memory.lookup(b"chat-1", 101.0) == "b:1"
    # ... and an entry learnt from the future expires as one made when it was learnt.
    assert memory.learn(key_hash(b"chat-2"), "a:1", 1e12, now=200.0)
    assert memory.lookup(b"chat-2", 260.0) == "a:1"
    assert memory.lookup(b"chat-2", 260.5) is None


def test_affinity_learns_newest_wins_and_the_hash_is_the_same_in_every_process() -> None:
    memory = Affinity(idle=60.0)
    digest = key_hash(b"chat-1")
    # BLAKE2b-64: a constant, not a salted per-process hash().
    assert digest == int.from_bytes(hashlib.blake2b(b"chat-1", digest_size=8).digest())
    memory.sent(b"chat-1", "a:1", 100.0)
    assert not memory.learn(digest, "b:1", 99.0, now=100.0)
    assert memory.lookup(b"chat-1", 100.0) == "a:1"
    assert memory.learn(digest, "b:1", 101.0, now=101.0)
    assert memory.lookup(b"chat-1", 101.0) == "b:1"
    assert not memory.learn(key_hash(b"old"), "b:1", 10.0, now=101.0)  # older than idle
    seen: list[tuple[int, str, float]] = []
    memory.share = lambda *args: seen.append(args)
    memory.sent(b"chat-2", "c:1", 102.0)
    assert seen == [(key_hash(b"chat-2"), "c:1", 102.0)]
