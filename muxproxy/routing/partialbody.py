"""What routing reads from a request body it holds only the start of: the members of a JSON
object that make its facts (``llmrequest.py``), read from its first bytes.

Obeys the routing rules: pure code, standard library and attrs only, no clock, no I/O, never
raises on client input, and stops at a bound. Why it exists: a body longer than
``sticky.body_limit`` (a long conversation: every turn repeats the history) is routed before
it has all arrived, so it cannot be parsed whole; but its prefix key depends only on its
first messages (the system part and the first turn), which come first. Without this, a
conversation lost its key, and its server, exactly when its history made the server's cache
worth most.

The read (``leading_document``): the top-level members of the object, in order, as far as the
held bytes go, up to ``messages``. ``messages``: its elements one by one, each parsed whole
once its end is held, up to and including the first that is not a system or developer message
(the prefix key needs no more), and the read ends there; ``prompt`` (a completion),
``model``, ``max_tokens``, ``max_completion_tokens`` and ``n``: their value, once its end is
held; any other member is skipped without being decoded (``models.py``'s scanner: strings,
escapes and nesting). The
result is a document of what was read, which ``llmrequest.read_request`` reads as it reads a
whole one, so a conversation's key is the same whether its body was held whole or not. A
first turn cut off by the end of what is held leaves the key to the system part alone.

Cost: one pass over the bytes before the first turn's end (at most the held bytes,
``sticky.body_limit``, 64 KiB by default), with ``json.loads`` only of the members kept; at
most ``MAX_MEMBERS`` top-level members are looked at.
"""

from __future__ import annotations

import json

from muxproxy.routing.models import (
    _UTF8_BOM,
    _decode,
    _Invalid,
    _OutOfData,
    _skip_whitespace,
    _string_end,
    _value_end,
)

__all__ = ["MAX_MEMBERS", "leading_document"]

MAX_MEMBERS = 64
"""Top-level members looked at at most: a request's object has a dozen or so; one with
thousands of tiny members is nobody's chat request, and the read stops instead."""

_SCALARS = frozenset({"prompt", "model", "max_tokens", "max_completion_tokens", "n"})
_SYSTEM_ROLES = frozenset({"system", "developer"})


def leading_document(prefix: bytes) -> dict[str, object] | None:
    """The members of the JSON object whose first bytes are ``prefix`` that make its facts
    (see the module header); None when ``prefix`` is not the start of a JSON object or holds
    none of them. Never raises."""
    found: dict[str, object] = {}
    try:
        _scan(prefix, found)
    except (_OutOfData, _Invalid, ValueError, RecursionError):
        pass  # what was read before the end (or the fault) stands
    return found or None


def _scan(data: bytes, found: dict[str, object]) -> None:
    index = _skip_whitespace(data, 3 if data.startswith(_UTF8_BOM) else 0)
    if data[index] != ord("{"):
        return
    index = _skip_whitespace(data, index + 1)
    for _ in range(MAX_MEMBERS):
        if data[index] != ord('"'):
            return
        key_end = _string_end(data, index)
        name = _decode(data[index:key_end])
        index = _skip_whitespace(data, key_end)
        if data[index] != ord(":"):
            return
        index = _skip_whitespace(data, index + 1)
        if name == "messages" and data[index] == ord("["):
            messages: list[object] = []
            found[name] = messages  # kept as far as it is read
            _messages(data, index, messages)
            return
        else:
            end = _value_end(data, index)
            if name in _SCALARS:
                found[name] = json.loads(data[index:end].decode("utf-8"))
            index = end
        index = _skip_whitespace(data, index)
        if data[index] != ord(","):
            return
        index = _skip_whitespace(data, index + 1)


def _messages(data: bytes, index: int, messages: list[object]) -> None:
    """Read the array at ``index`` into ``messages`` up to the first message that is not a
    system or developer one. The members after the array are not read: in a body longer than
    may be held they seldom are (the OpenAI SDK writes ``messages`` first), and skipping a
    long history unread still costs a pass over it (3 ms for 64 KiB of turns)."""
    index = _skip_whitespace(data, index + 1)
    while data[index] != ord("]"):
        end = _value_end(data, index)
        message = json.loads(data[index:end].decode("utf-8"))
        messages.append(message)
        if not isinstance(message, dict) or message.get("role") not in _SYSTEM_ROLES:
            return
        index = _skip_whitespace(data, end)
        if data[index] == ord(","):
            index = _skip_whitespace(data, index + 1)
        elif data[index] != ord("]"):
            return
