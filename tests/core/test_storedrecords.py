"""What a shared resume store returns is checked before use (``core/streams/storedrecords.py``)."""

from __future__ import annotations

import json

import pytest

from muxproxy.core.streams.storedrecords import (
    MAX_EVENT_BYTES,
    MAX_FIELDS,
    BadRecord,
    stored_event,
    stored_meta,
    stored_seq,
    stored_state,
)


def meta(**changes: bytes) -> dict[bytes, bytes]:
    fields = {
        b"credential": b"c" * 32,
        b"status": b"200",
        b"headers": json.dumps([["content-type", "text/event-stream"]]).encode(),
        b"version": b"1.1",
        b"state": b"live",
        b"first": b"1",
        b"last": b"3",
    }
    fields.update({name.encode(): value for name, value in changes.items()})
    return fields


def test_a_record_as_the_owner_writes_it_is_read_back() -> None:
    checked = stored_meta(meta())
    assert checked.head.status == 200 and checked.head.version == "1.1"
    assert checked.head.headers == ((b"content-type", b"text/event-stream"),)
    assert (checked.state, checked.first, checked.last) == ("live", 1, 3)
    assert stored_meta(meta(first=b"1", last=b"0")).first == 1  # nothing held yet


def headers(*pairs: object) -> bytes:
    return json.dumps(list(pairs)).encode()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"status": b"999"}, "status 999"),
        ({"status": b"101"}, "status 101"),
        ({"status": b"-200"}, "decimal digits"),
        ({"status": b"2" * 30}, "decimal digits"),
        ({"headers": headers(["x-a", "1\r\nx-injected: 1"])}, "control"),
        ({"headers": headers(["x-a", "a\nb"])}, "control"),
        ({"headers": headers(["x-a", "a\x00b"])}, "control"),
        ({"headers": headers(["x-a", " padded"])}, "control"),
        ({"headers": headers(["X-Upper", "1"])}, "lower-case token"),
        ({"headers": headers(["bad name", "1"])}, "lower-case token"),
        ({"headers": headers(["x:a", "1"])}, "lower-case token"),
        ({"headers": headers(["x-a", "\u0100"])}, "control"),
        ({"headers": headers(["x-a"])}, "pairs of strings"),
        ({"headers": headers(["x-a", 1])}, "pairs of strings"),
        ({"headers": b'{"x-a": "1"}'}, "list"),
        ({"headers": b"[["}, "not JSON"),
        ({"headers": headers(*[["x-a", "1"]] * (MAX_FIELDS + 1))}, "at most"),
        ({"headers": headers(*[[f"x-{n}", "v" * 4000] for n in range(20)])}, "bytes"),
        ({"version": b"3"}, "version"),
        ({"version": b"\xff"}, "version"),
        ({"state": b"zombie"}, "state"),
        ({"first": b"5", "last": b"3"}, "first"),
        ({"first": b"0"}, "first"),
        ({"last": b"x"}, "decimal digits"),
        ({"credential": b"short"}, "digest"),
        ({"credential": b""}, "digest"),
    ],
)
def test_a_bad_meta_record_is_refused_with_its_reason(
    changes: dict[str, bytes], reason: str
) -> None:
    with pytest.raises(BadRecord) as raised:
        stored_meta(meta(**changes))
    assert reason in raised.value.reason


@pytest.mark.parametrize("missing", [b"status", b"headers", b"version", b"state", b"first"])
def test_a_meta_record_without_a_field_is_refused(missing: bytes) -> None:
    fields = meta()
    del fields[missing]
    with pytest.raises(BadRecord, match="missing"):
        stored_meta(fields)


def test_entries_states_and_events_are_checked() -> None:
    assert stored_seq(b"0-7") == 7 and stored_seq("0-1") == 1
    for bad in (b"0-0", b"1-7", b"0-x", b"0-" + b"9" * 19, b"7"):
        with pytest.raises(BadRecord):
            stored_seq(bad)
    assert stored_state(b"ended") == "ended"
    with pytest.raises(BadRecord):
        stored_state(b"LIVE")
    assert stored_event(b"data: a\n\n") == b"data: a\n\n"
    with pytest.raises(BadRecord, match="no data"):
        stored_event(None)
    with pytest.raises(BadRecord, match="more than"):
        stored_event(b"x" * (MAX_EVENT_BYTES + 1))
