"""Request paths as routes see them: normalised once (RFC 3986 §6.2.2), or refused.

A route is a path prefix, and a prefix is only a boundary if the proxy and the backend agree
on what the path is. A backend that resolves dot-segments or decodes percent-encoding serves
``/flag`` for ``/v1/../flag``, ``/v1/%2e%2e/flag`` or ``/v1/..%2fflag``, all of which start
with ``/v1/``. So the proxy matches routes on the normalised path and forwards that same path,
which leaves the backend nothing to resolve. The rules, applied to the path (the query, after
the first ``?``, is never touched):

* RFC 3986 §6.2.2.2: a percent-encoded unreserved character (ALPHA, DIGIT, ``-._~``) is the
  character itself, so it is decoded: ``%2e`` is ``.``, ``%76%31`` is ``v1``. Every other
  percent-encoding is kept exactly as sent.
* RFC 3986 §5.2.4 ``remove_dot_segments``: ``.`` and ``..`` segments are resolved (``..`` at
  the root stays at the root).
* An encoded slash or backslash (``%2f``, ``%5c``) is kept as sent, inside its segment (RFC
  3986 §2.2: encoded, a reserved character is data): ``/v1/models/org%2Fmodel`` names a model
  whose id holds a slash. Backends disagree on them (one decodes ``%2f`` into a separator,
  another keeps it in the segment), which is harmless unless a dot-segment hides behind one:
  a path that has a ``.`` or ``..`` segment once they are read as separators (``..%2f``) is
  refused with 400, since no single normalised form of it is safe to forward.
* Likewise a ``.`` or ``..`` segment behind a path parameter (``/v1/..;/flag``,
  ``/v1/%2e%2e;x/flag``): RFC 3986 §3.3 makes ``..;`` an ordinary segment, so it survives
  ``remove_dot_segments``, but servers that strip ``;`` parameters before resolving
  (Tomcat, Jetty, Spring) read it as ``..`` and leave the route's prefix. Refused with 400,
  as is ``%3b`` in its place.
* Also refused with 400: a raw backslash (a separator to some servers; not a character RFC
  3986 §3.3 allows in a path) and a ``%`` not followed by two hex digits (RFC 3986 §2.1).

Run once per request, before routing; a path with no ``%``, no ``\\`` and no ``/.`` (nearly
every path) costs three substring searches and is returned as it is. Targets that are not
origin-form (``*`` for OPTIONS, a CONNECT's empty one) are returned unchanged.
"""

from __future__ import annotations

import re

from muxproxy.core.http.intake import MalformedRequest

__all__ = ["normalise_target"]

# RFC 3986 §2.1: "%" HEXDIG HEXDIG; the group is missing for a malformed one.
_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})?")
# RFC 3986 §2.3 unreserved characters.
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# Encoded separators: "/" and "\" (RFC 3986 §2.1: hex digits in either case).
_ENCODED_SEPARATOR = re.compile(rb"%(?:2[fF]|5[cC])")
# Where a segment's parameters begin (RFC 3986 §3.3), plain or encoded.
_PARAMETERS = re.compile(rb";|%3[bB]")


def normalise_target(target: bytes) -> bytes:
    """The request target with its path normalised (module docstring); raises
    ``MalformedRequest`` (400) for a path that cannot be normalised safely."""
    if target[:1] != b"/":
        return target
    path, question, query = target.partition(b"?")
    if b"%" not in path and b"\\" not in path and b"/." not in path:
        return target
    if b"\\" in path:
        raise MalformedRequest("backslash in the request path")
    if b"%" in path:
        path = _PERCENT.sub(_decode_unreserved, path)
    if b"/." in path:
        path = remove_dot_segments(path)
    # The plain dot-segments are gone: one that is left hides behind an encoded separator
    # or a path parameter.
    if b"%" in path and _ENCODED_SEPARATOR.search(path) is not None and _hides_dot_segment(path):
        raise MalformedRequest("dot-segment behind an encoded slash in the request path")
    if (b";" in path or b"%" in path) and _hides_dot_segment(path):
        raise MalformedRequest("dot-segment behind a path parameter in the request path")
    return path + question + query


def _decode_unreserved(match: re.Match[bytes]) -> bytes:
    digits = match[1]
    if digits is None:
        raise MalformedRequest("invalid percent-encoding in the request path")
    byte = int(digits, 16)
    if byte in _UNRESERVED:
        return bytes((byte,))
    return match[0]


def _hides_dot_segment(path: bytes) -> bool:
    """Whether ``path`` has a ``.`` or ``..`` segment once ``%2f`` and ``%5c`` are read as
    separators and each segment's ``;`` parameters (``%3b`` too) are stripped (after the
    unreserved characters were decoded and ``remove_dot_segments``)."""
    segments = _ENCODED_SEPARATOR.sub(b"/", path).split(b"/")
    split = _PARAMETERS.split
    return any(split(segment, 1)[0] in (b".", b"..") for segment in segments)


def remove_dot_segments(path: bytes) -> bytes:
    """RFC 3986 §5.2.4 for an absolute path (one that starts with ``/``)."""
    segments = path.split(b"/")[1:]
    out: list[bytes] = []
    for segment in segments:
        if segment == b"..":
            if out:
                out.pop()
        elif segment != b".":
            out.append(segment)
    if segments[-1] in (b".", b".."):
        # "/a/b/.." is "/a/": the last dot-segment leaves its directory's trailing slash.
        out.append(b"")
    return b"/" + b"/".join(out)
