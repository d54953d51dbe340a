"""The fleet's runtime state as data (``muxproxy/fleet/state.py``): what a replica does with a
document it reads or is sent, and what it accepts as one.

The scripts themselves run against a real ``redis-server`` in ``tests/trio/test_fleetstate.py``.
"""

from __future__ import annotations

import json

import attrs
import pytest

from muxproxy.config.runtime import RuntimeState
from muxproxy.fleet.state import (
    FleetDocument,
    Step,
    cas_outcome,
    decide,
    document_from_hash,
    document_from_message,
)

STATE = RuntimeState.empty().changed("gpus", "10.0.0.1:8000", weight=3)
OTHER = RuntimeState.empty().changed("gpus", "10.0.0.2:8000", drain=True)


def doc(version: int, lineage: str = "aa", *, seeded: bool = False) -> FleetDocument:
    return FleetDocument(version=version, lineage=lineage, seeded=seeded, state=STATE)


@pytest.mark.parametrize(
    ("held", "stored", "step"),
    [
        # An empty store is never "no overrides": it is seeded with what the replica has.
        (doc(4), None, Step.SEED),
        (FleetDocument.unsynced(STATE), None, Step.SEED),
        # A seed older than what the replica has: the newest state must win.
        (doc(7), doc(5, "bb", seeded=True), Step.SEED),
        (doc(5, "bb"), doc(5, "bb", seeded=True), Step.KEEP),
        (doc(5), doc(7, "bb", seeded=True), Step.APPLY),
        # A change made on top of a seed is the store's truth, whatever the replica had.
        (doc(7), doc(6, "bb"), Step.APPLY),
        # The same history: newer applies, the same or older (a late message) is kept.
        (doc(4), doc(5), Step.APPLY),
        (doc(5), doc(5), Step.KEEP),
        (doc(6), doc(5), Step.KEEP),
        # A replica that never synced takes the store's, even at version 0.
        (FleetDocument.unsynced(OTHER), doc(0, "cc", seeded=True), Step.APPLY),
    ],
)
def test_a_replica_applies_keeps_or_seeds(
    held: FleetDocument, stored: FleetDocument | None, step: Step
) -> None:
    assert decide(held, stored) is step


def stored_fields(document: FleetDocument) -> dict[bytes, bytes]:
    return {
        b"version": str(document.version).encode(),
        b"lineage": document.lineage.encode(),
        b"seeded": b"1" if document.seeded else b"0",
        b"state": document.state_json().encode(),
    }


def test_a_stored_document_reads_back_as_written() -> None:
    document = FleetDocument(version=12, lineage="0f9e", seeded=True, state=STATE)
    assert document_from_hash(stored_fields(document)) == document
    assert document_from_hash({}) is None
    # A model alias's runtime weights travel in the same document as the servers'.
    with_models = attrs.evolve(document, state=STATE.models_changed("chat", {"v2": 10}))
    assert document_from_hash(stored_fields(with_models)) == with_models


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({b"version": b"-1"}, "version: expected a non-negative integer"),
        ({b"version": b"1" * 19}, "version: expected a non-negative integer"),
        ({b"lineage": b'x","evil":"'}, "lineage: expected a hex id"),
        ({b"lineage": b""}, "lineage: expected a hex id"),
        ({b"seeded": b"yes"}, "seeded: expected 0 or 1"),
        ({b"state": b"{"}, "state: "),
        ({b"state": b'{"version": 1, "servers": [{"group": "g"}]}'}, "state: servers[0].address"),
    ],
)
def test_a_bad_stored_document_is_refused_naming_the_field(
    change: dict[bytes, bytes], message: str
) -> None:
    fields = stored_fields(doc(3)) | change
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        document_from_hash(fields)


def test_a_document_with_a_field_missing_is_refused() -> None:
    fields = stored_fields(doc(3))
    del fields[b"lineage"]
    with pytest.raises(ValueError, match="lineage: missing"):
        document_from_hash(fields)


def test_a_message_reads_as_the_document_it_carries() -> None:
    document = FleetDocument(version=9, lineage="ab12", seeded=False, state=OTHER)
    # What the scripts publish: the state's JSON spliced in as the client wrote it.
    message = (
        f'{{"version":9,"lineage":"ab12","seeded":false,"state":{document.state_json()}}}'
    ).encode()
    assert document_from_message(message) == document


@pytest.mark.parametrize(
    ("message", "why"),
    [
        (b"[", "not JSON"),
        (b"[]", "expected an object"),
        (b'{"version": 1}', "expected an object with version"),
        (
            json.dumps({"version": True, "lineage": "ab", "seeded": False, "state": {}}),
            "version: expected a non-negative integer",
        ),
        (
            json.dumps({"version": 1, "lineage": "ab", "seeded": 0, "state": {}}),
            "seeded: expected true or false",
        ),
        (
            json.dumps({"version": 1, "lineage": "ab", "seeded": False, "state": {}}),
            "state: version: expected 1",
        ),
        (b" " * (4 * 1024 * 1024 + 1), "larger than"),
    ],
)
def test_a_bad_message_is_refused_saying_why(message: bytes | str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        document_from_message(message)


def test_the_compare_and_set_reply_is_read_or_refused() -> None:
    assert cas_outcome([1, 8]) == (1, 8)
    assert cas_outcome([-1, 7]) == (-1, 7)
    assert cas_outcome([0, 0]) == (0, 0)
    for reply in ([2, 1], [1], "OK", [True, 1], None):
        with pytest.raises(ValueError, match="compare-and-set"):
            cas_outcome(reply)
