"""What a shared resume store returns, checked as if a backend had sent it.

What it obeys, and why:

- **The store is not trusted.** Redis is shared by every replica and anyone who can reach
  it can write a stream's keys (``trio/resumestore.py`` reads them), so nothing read back
  goes to a client unchecked: a head whose status or fields would be refused from a backend
  is refused from the store, so a record can neither split a response (a CR or LF in a
  field ends the head early: RFC 9112 §2.2, RFC 9113 §8.2.1) nor relay a status that
  no HTTP has (RFC 9110 §15: 100..599; a resumed head is final, so not 1xx).
- **Field names** are tokens (RFC 9110 §5.1) in lower case (RFC 9113 §8.2.1: an HTTP/2
  field name with upper case is malformed, and a stream begun over HTTP/1.1 may be resumed
  over HTTP/2); **values** are field-vchars, SP and HTAB, without leading or trailing
  whitespace (RFC 9110 §5.5): never CR, LF or NUL.
- **Sizes and numbers are bounded**: at most ``MAX_FIELDS`` fields and ``MAX_HEAD_BYTES`` of
  them, an event at most ``MAX_EVENT_BYTES``, a sequence number an integer 0..``MAX_SEQ``
  written in decimal digits, ``first`` at most ``last + 1``, a credential digest of
  ``DIGEST_BYTES``, a state one of ``live``, ``ended``, ``broken``.
- A record that breaks any of these raises ``BadRecord`` with the reason; the caller drops
  it (it is not used), logs the reason with the stream's token, and answers the client
  cleanly (a 502 before the head, a visible truncation after it: ``core/exchange/replay.py``).

Pure: functions of what was read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import attrs

from muxproxy.core.events import ResumedHead

MAX_FIELDS = 128
"""Most fields of a stored head (``limits.max_header_fields``' default)."""
MAX_HEAD_BYTES = 64 * 1024
"""Most bytes of a stored head's names and values (``limits.max_request_head``' default)."""
MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Most bytes of one stored event. The owner keeps about ``resume.window`` bytes of events
(at most a few MiB in any sane configuration); far more is not an event of ours."""
MAX_SEQ = 10**18 - 1
"""The largest sequence number (``resume.parse_event_id`` reads at most 18 digits)."""
DIGEST_BYTES = 32
"""A binding's digest (``resumebind.binding``: SHA-256)."""
STATES = frozenset({"live", "ended", "broken"})
VERSIONS = frozenset({"1.0", "1.1", "2"})
"""The backend HTTP versions a stream is written with (``Exchange.upstream_version``)."""

_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
_VCHAR = r"[\x21-\x7e\x80-\xff]"
_VALUE = re.compile(rf"(?:{_VCHAR}(?:[\x20\x09\x21-\x7e\x80-\xff]*{_VCHAR})?)?\Z")
_DIGITS = re.compile(rb"[0-9]{1,18}\Z")
_ENTRY_ID = re.compile(r"0-([0-9]{1,18})\Z")


class BadRecord(ValueError):
    """A stored record that must not be used; ``reason`` says why (for the log)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@attrs.frozen(kw_only=True)
class StoredMeta:
    """A stream's meta hash, checked."""

    credential: bytes
    head: ResumedHead
    state: str
    first: int
    """The oldest seq the store holds (``last + 1`` when it holds none)."""
    last: int


def stored_meta(fields: Mapping[bytes, bytes]) -> StoredMeta:
    """The meta hash ``fields`` (every key present), checked; raises ``BadRecord``."""
    credential = _field(fields, b"credential")
    if len(credential) != DIGEST_BYTES:
        raise BadRecord(f"credential: expected a {DIGEST_BYTES}-byte digest")
    first, last = stored_number(_field(fields, b"first")), stored_number(_field(fields, b"last"))
    if not 1 <= first <= last + 1:
        raise BadRecord(f"first {first} and last {last}: expected 1 <= first <= last + 1")
    return StoredMeta(
        credential=credential,
        head=stored_head(
            _field(fields, b"status"), _field(fields, b"headers"), _field(fields, b"version")
        ),
        state=stored_state(_field(fields, b"state")),
        first=first,
        last=last,
    )


def stored_head(status: bytes, headers: bytes, version: bytes) -> ResumedHead:
    """A stored response head, checked as a backend's final head is; raises ``BadRecord``."""
    code = stored_number(status)
    if not 200 <= code <= 599:
        raise BadRecord(f"status {code}: expected a final status, 200..599")
    try:
        decoded = version.decode("ascii")
    except UnicodeDecodeError:
        decoded = ""
    if decoded not in VERSIONS:
        raise BadRecord(f"version {version[:16]!r}: expected one of {sorted(VERSIONS)}")
    try:
        pairs = json.loads(headers)
    except (ValueError, RecursionError):
        raise BadRecord("headers: not JSON") from None
    if not isinstance(pairs, list) or len(pairs) > MAX_FIELDS:
        raise BadRecord(f"headers: expected a list of at most {MAX_FIELDS} fields")
    fields: list[tuple[bytes, bytes]] = []
    size = 0
    for pair in pairs:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(part, str) for part in pair)
        ):
            raise BadRecord("headers: expected [name, value] pairs of strings")
        name, value = pair
        if not _NAME.match(name):
            raise BadRecord(f"header name {name[:64]!r}: expected a lower-case token")
        if not _VALUE.match(value):
            raise BadRecord(f"header {name!r}: its value holds CR, LF, NUL or another control")
        size += len(name) + len(value)
        if size > MAX_HEAD_BYTES:
            raise BadRecord(f"headers: more than {MAX_HEAD_BYTES} bytes")
        fields.append((name.encode("latin-1"), value.encode("latin-1")))
    return ResumedHead(status=code, headers=tuple(fields), version=decoded)


def stored_state(value: bytes) -> str:
    """A stream's state (``live``, ``ended``, ``broken``); raises ``BadRecord``."""
    state = value.decode("ascii", "replace")
    if state not in STATES:
        raise BadRecord(f"state {value[:16]!r}: expected one of {sorted(STATES)}")
    return state


def stored_number(value: bytes) -> int:
    """A decimal sequence number or status, 0..``MAX_SEQ``; raises ``BadRecord``."""
    if not _DIGITS.match(value):
        raise BadRecord(f"{value[:24]!r}: expected decimal digits, at most 18")
    return int(value)


def stored_seq(identifier: bytes | str) -> int:
    """An event's seq from its stream entry id (``0-<seq>``, seq >= 1); raises
    ``BadRecord``."""
    text = identifier.decode("ascii", "replace") if isinstance(identifier, bytes) else identifier
    match = _ENTRY_ID.match(text)
    if match is None or int(match[1]) < 1:
        raise BadRecord(f"entry id {text[:24]!r}: expected 0-<seq>, seq >= 1")
    return int(match[1])


def stored_event(data: object) -> bytes:
    """An event's bytes as sent, at most ``MAX_EVENT_BYTES``; raises ``BadRecord``."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, bytes):
        raise BadRecord("event: no data field")
    if len(data) > MAX_EVENT_BYTES:
        raise BadRecord(f"event: {len(data)} bytes, more than {MAX_EVENT_BYTES}")
    return data


def _field(fields: Mapping[bytes, bytes], name: bytes) -> bytes:
    value = fields.get(name)
    if not isinstance(value, bytes):
        raise BadRecord(f"{name.decode()}: missing")
    return value
