"""Routing by model: the ``"model"`` of a JSON request body, model patterns, rewriting the
model, and choosing one of an alias's weighted targets.

Obeys the routing rules: pure code, standard library and attrs only (no trio, asyncio, socket,
ssl, select, time, random), no clock, no I/O; randomness comes in as an argument. Why: the
decisions are the same in every replica and in tests, and a request body is untrusted input,
so reading it must never raise and must stop at a bound.

The body is read from its first bytes (``find_model``) so a request can be placed before the
whole body has arrived: the top-level ``model`` member usually comes first, but it may come
after a long ``messages`` array, which is skipped (strings, escapes and nesting included)
without being decoded. The scan is stateless: the caller passes the whole prefix received so
far each time; ``limit`` bounds the work of one call (a 64 KiB prefix dense with escapes
takes a few milliseconds), so a caller rescans when the prefix has grown by a read, not per
byte, and gives up at the limit.

A body that repeats the top-level ``model`` member is ``Duplicate``: JSON leaves duplicate
names undefined (RFC 8259 §4), and parsers disagree on which wins (Python's ``json`` and
the engines built on it take the last, a streaming reader the first), so the proxy could
route by one model while the engine serves another. The scan therefore goes on past the
``model`` value to the object's end; only within ``limit``: a repeat past it is not seen.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

from muxproxy.config.routes import model_matches
from muxproxy.config.serverid import server_id
from muxproxy.routing.balancer import rendezvous_order

__all__ = [
    "Duplicate",
    "Found",
    "NeedMore",
    "NotFound",
    "Random",
    "find_model",
    "matches",
    "pick_target",
    "rewrite_model",
]


@attrs.frozen
class Found:
    """The top-level ``model`` string and the byte span of its JSON value (quotes included):
    ``body[span[0]:span[1]]`` is the encoded string that ``rewrite_model`` replaces."""

    model: str
    span: tuple[int, int]


@attrs.frozen
class Duplicate:
    """The object names a top-level ``model`` twice (or more): refused, never routed."""

    model: str
    """The first one's value."""


@attrs.frozen
class NeedMore:
    """Undecided: the prefix ends before the ``model`` member (or the object) does."""


@attrs.frozen
class NotFound:
    """No model to route by; ``reason`` says why, for the log."""

    reason: str


class _OutOfData(Exception):
    """The scan reached the end of the bytes it may read."""


class _Invalid(Exception):
    """The bytes read so far are not the start of a JSON object with a string ``model``."""


_WHITESPACE = b" \t\n\r"
_STRING_STOP = re.compile(rb'["\\]')
_NESTED_STOP = re.compile(rb'["\[\]{}]')
_SCALAR_END = re.compile(rb"[,}\]\s]")
_CLOSER = {ord("["): ord("]"), ord("{"): ord("}")}
_UTF8_BOM = b"\xef\xbb\xbf"


def find_model(
    prefix: bytes, *, complete: bool, limit: int
) -> Found | Duplicate | NeedMore | NotFound:
    """The top-level ``"model"`` string of a JSON object body, read from ``prefix``.

    ``complete`` says the prefix is the whole body. Only the first ``limit`` bytes are read:
    ``NeedMore`` while undecided with fewer than ``limit`` bytes and more to come;
    ``NotFound`` when the body is not a JSON object, has no top-level ``model`` string, or
    passes ``limit`` before its ``model`` value ends; ``Duplicate`` when a second top-level
    ``model`` member comes within ``limit``. ``Found`` once the object ends, or the body or
    ``limit`` ends after the model's value. Never raises on any bytes.
    """
    data = prefix[: max(limit, 0)]
    found: list[Found] = []
    try:
        return _scan(data, found)
    except _Invalid as error:
        return found[0] if found else NotFound(str(error))
    except _OutOfData:
        if found and (complete or len(prefix) >= limit):
            return found[0]  # no repeat within what may be read
        if found:
            return NeedMore()
        if len(prefix) >= limit:
            return NotFound(f"no model in the first {limit} bytes")
        if complete:
            return NotFound("the body ends before its model")
        return NeedMore()
    except (ValueError, RecursionError) as error:  # a decoding corner not foreseen: no route
        return NotFound(f"unreadable body: {error}")


def _scan(data: bytes, found: list[Found]) -> Found | Duplicate | NotFound:
    """The scan of ``find_model``; ``found`` receives the model once its value is read (the
    scan goes on for a repeat)."""
    if len(data) < len(_UTF8_BOM) and _UTF8_BOM.startswith(data):
        raise _OutOfData  # perhaps a byte order mark's first bytes
    index = _skip_whitespace(data, 3 if data.startswith(_UTF8_BOM) else 0)
    if data[index] != ord("{"):
        raise _Invalid("the body is not a JSON object")
    index = _skip_whitespace(data, index + 1)
    if data[index] == ord("}"):
        return NotFound("the body has no model")
    while True:
        if data[index] != ord('"'):
            raise _Invalid("the body is not valid JSON")
        key_end = _string_end(data, index)
        key = data[index:key_end]
        is_model = key == b'"model"' or (b"\\" in key and _decode(key) == "model")
        index = _skip_whitespace(data, key_end)
        if data[index] != ord(":"):
            raise _Invalid("the body is not valid JSON")
        index = _skip_whitespace(data, index + 1)
        if is_model and found:
            return Duplicate(found[0].model)
        if is_model:
            if data[index] != ord('"'):
                raise _Invalid("the model is not a string")
            end = _string_end(data, index)
            found.append(Found(_decode(data[index:end]), (index, end)))
            index = end
        else:
            index = _value_end(data, index)
        index = _skip_whitespace(data, index)
        if data[index] == ord("}"):
            return found[0] if found else NotFound("the body has no model")
        if data[index] != ord(","):
            raise _Invalid("the body is not valid JSON")
        index = _skip_whitespace(data, index + 1)


def _at(data: bytes, index: int) -> int:
    if index >= len(data):
        raise _OutOfData
    return data[index]


def _skip_whitespace(data: bytes, index: int) -> int:
    while _at(data, index) in _WHITESPACE:
        index += 1
    return index


def _string_end(data: bytes, index: int) -> int:
    """The index just past the string whose opening quote is at ``index``."""
    index += 1
    while True:
        stop = _STRING_STOP.search(data, index)
        if stop is None:
            raise _OutOfData
        if data[stop.start()] == ord('"'):
            return stop.start() + 1
        _at(data, stop.start() + 1)  # the escaped byte must be here (\" or \\ or \u...)
        index = stop.start() + 2


def _value_end(data: bytes, index: int) -> int:
    """The index just past the JSON value starting at ``index`` (validated loosely: enough
    to find where it ends; the backend judges the rest)."""
    first = data[index]
    if first == ord('"'):
        return _string_end(data, index)
    if first not in _CLOSER:
        end = _SCALAR_END.search(data, index)
        if end is None:
            raise _OutOfData
        if end.start() == index:
            raise _Invalid("the body is not valid JSON")
        return end.start()
    expected = [_CLOSER[first]]
    index += 1
    while expected:
        stop = _NESTED_STOP.search(data, index)
        if stop is None:
            raise _OutOfData
        byte = data[stop.start()]
        if byte == ord('"'):
            index = _string_end(data, stop.start())
            continue
        if byte in _CLOSER:
            expected.append(_CLOSER[byte])
        elif byte != expected.pop():
            raise _Invalid("the body is not valid JSON")
        index = stop.start() + 1
    return index


def _decode(encoded: bytes) -> str:
    """A JSON string's value; ``_Invalid`` for bad escapes, control bytes or UTF-8."""
    try:
        value = json.loads(encoded.decode("utf-8"))  # bytes would let json guess UTF-16/32
    except ValueError as error:
        raise _Invalid(f"a string is not valid JSON: {error}") from None
    assert isinstance(value, str)
    return value


def matches(model: str, patterns: Iterable[str]) -> bool:
    """Whether ``model`` is one of ``patterns``: exact names or shell-style globs
    (``fnmatchcase``, case-sensitive everywhere: ``"llama-3.1-70b*"``)."""
    return model_matches(model, patterns)


def rewrite_model(body: bytes, span: tuple[int, int], new: str) -> bytes:
    """``body`` with the JSON value at ``span`` (from ``Found``) replaced by ``new`` encoded as
    a JSON string (ASCII, escaped); every other byte unchanged."""
    start, end = span
    return body[:start] + json.dumps(new).encode("ascii") + body[end:]


class Random(Protocol):
    """What ``pick_target`` needs of a random source (``random.Random`` has it)."""

    def random(self) -> float: ...


def pick_target(
    targets: Sequence[tuple[str, int]],
    session_key: bytes | None,
    rng: Random,
    *,
    alias: str = "",
) -> str | None:
    """One of an alias's ``(model, weight)`` targets; None when no weight is above 0.

    With a session key, weighted rendezvous hashing over the targets' ids (``server_id`` of
    ``alias`` and the model name): a conversation keeps its target while the weights stay, and
    a change of weights moves only the keys the change must move. Without one, a weighted
    random pick with ``rng``. A weight of 0 or less is never chosen.
    """
    weights = [weight for _, weight in targets]
    if session_key is not None:
        ids = [server_id(alias, name) for name, _ in targets]
        order = rendezvous_order(session_key, ids, weights, range(len(targets)))
        return targets[order[0]][0] if order else None
    total = sum(weight for weight in weights if weight > 0)
    if total <= 0:
        return None
    point = rng.random() * total
    chosen: str | None = None
    for name, weight in targets:
        if weight <= 0:
            continue
        chosen = name  # the last positive target absorbs float rounding at the top end
        point -= weight
        if point < 0:
            break
    return chosen
