"""Session keys for sticky routing, the sticky cookie, and request-header templates.

Obeys the routing rules: pure code, standard library and attrs only (no trio, asyncio,
socket, ssl, select, time, random), no clock, no I/O, never raises on client input. Why: it
runs on every request in the sans-IO core, its answers must depend only on the request (so
every proxy replica keys a session the same way), and tests need no mocks.

Headers are ``(name, value)`` byte pairs as the core holds them; names are compared in lower
case. ``target`` is the request target (``/v1/chat?session=abc``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from urllib.parse import unquote_to_bytes

from muxproxy.config import HeaderRule, SessionSource, StickyCookie
from muxproxy.routing.llmrequest import parse_json_body

__all__ = [
    "apply_header_rules",
    "cookie_value",
    "expand_header_rule",
    "header_value",
    "query_arg",
    "session_key_from_body",
    "session_key_from_head",
    "set_cookie_header",
    "source_value",
    "unknown_variables",
]

Headers = Iterable[tuple[bytes, bytes]]

_OWS = b" \t"


def _as_sequence(headers: Headers) -> Sequence[tuple[bytes, bytes]]:
    return headers if isinstance(headers, Sequence) else tuple(headers)


def cookie_value(headers: Headers, name: str) -> bytes | None:
    """The value of the first cookie called ``name`` in the ``cookie`` headers, or None.

    Every ``cookie`` header counts (HTTP/2 clients may send one per cookie), each parsed as
    RFC 6265 §5.4 ``name=value; name2=value2``. The value is returned as sent (possibly
    empty); pieces without ``=`` are ignored.
    """
    wanted = name.encode()
    for header, value in headers:
        if header.lower() != b"cookie":
            continue
        for piece in value.split(b";"):
            key, eq, val = piece.partition(b"=")
            if eq and key.strip(_OWS) == wanted:
                return val.strip(_OWS)
    return None


def header_value(headers: Headers, name: str) -> bytes | None:
    """The first value of the header ``name`` (compared in lower case), or None."""
    wanted = name.lower().encode()
    for header, value in headers:
        if header.lower() == wanted:
            return value.strip(_OWS)
    return None


def query_arg(target: bytes, name: str) -> bytes | None:
    """The first query argument ``name`` of the request target, percent-decoded, or None.

    Form decoding as :func:`urllib.parse.parse_qsl` does it (``+`` is a space, ``&``
    separates), on bytes so that any octets survive. Names are compared after decoding,
    case-sensitively.
    """
    _, question, query = target.partition(b"?")
    if not question:
        return None
    query = query.partition(b"#")[0]
    wanted = name.encode()
    for piece in query.split(b"&"):
        key, _, val = piece.partition(b"=")
        if _form_decode(key) == wanted:
            return _form_decode(val)
    return None


def _form_decode(raw: bytes) -> bytes:
    return unquote_to_bytes(raw.replace(b"+", b" ")) if raw else raw


def _head_value(
    source: SessionSource, headers: Sequence[tuple[bytes, bytes]], target: bytes
) -> bytes | None:
    if source.kind == "cookie":
        return cookie_value(headers, source.name)
    if source.kind == "header":
        return header_value(headers, source.name)
    if source.kind == "query":
        return query_arg(target, source.name)
    return None


def session_key_from_head(
    sources: Sequence[SessionSource], headers: Headers, target: bytes
) -> tuple[bytes | None, bool]:
    """The session key as far as the request head can tell: ``(key, need_body)``.

    Sources are tried in order: ``(key, False)`` for the first that has a non-empty value;
    ``(None, True)`` on reaching a ``body`` source first (hold the body, then call
    :func:`session_key_from_body`); ``(None, False)`` if no source has a key.
    """
    headers = _as_sequence(headers)
    for source in sources:
        if source.kind == "body":
            return None, True
        value = _head_value(source, headers, target)
        if value:
            return value, False
    return None, False


def session_key_from_body(
    sources: Sequence[SessionSource],
    headers: Headers,
    target: bytes,
    body: bytes,
    complete: bool,
    document: object = None,
) -> bytes | None:
    """The session key with the request body at hand: every source in order, or None.

    ``body`` sources parse the body as JSON, only if ``complete`` (the whole body was held
    within the limit; otherwise they yield nothing), and follow a dotted path of object keys
    (``metadata.session_id``). A string value is its UTF-8 bytes, a number its ``str()``;
    any other value (booleans, null, arrays, objects, NaN, infinities), a missing path or a
    body that is not JSON gives no key (never raises). ``document``: the body already
    parsed (``llmrequest.parse_json_body``), if the caller has it.
    """
    headers = _as_sequence(headers)
    parsed: list[object] = [] if document is None else [document]
    for source in sources:
        if source.kind != "body":
            value = _head_value(source, headers, target)
        elif not complete:
            continue
        else:
            if not parsed:
                parsed.append(parse_json_body(body))
            value = _json_path_value(parsed[0], source.name)
        if value:
            return value
    return None


def source_value(
    source: SessionSource, headers: Headers, target: bytes, document: object
) -> bytes | None:
    """The value of one source (a tenant, a priority): from the head, or from ``document``
    (the parsed body; None when the body was not read) for a ``body`` source."""
    if source.kind == "body":
        return None if document is None else _json_path_value(document, source.name)
    return _head_value(source, _as_sequence(headers), target) or None


def _json_path_value(document: object, path: str) -> bytes | None:
    node = document
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, str):
        return node.encode("utf-8", "surrogatepass")
    if isinstance(node, int) and not isinstance(node, bool):
        return str(node).encode("ascii")
    if isinstance(node, float) and math.isfinite(node):
        return str(node).encode("ascii")
    return None  # bool, null, array, object; NaN and infinities (not JSON numbers)


def set_cookie_header(cookie: StickyCookie, value: bytes) -> tuple[bytes, bytes]:
    """The ``set-cookie`` header that pins the client to a server (RFC 6265 §4.1).

    ``name=value; Path=/; Max-Age=N; Domain=d; HttpOnly; Secure; SameSite=Lax`` with only
    the configured attributes. ``value`` must be cookie octets (a :func:`server_id` is).
    ``expires`` is rounded up to whole seconds; 0 or less gives ``Max-Age=0``.
    """
    parts = [cookie.name.encode() + b"=" + value]
    if cookie.path:
        parts.append(b"Path=" + cookie.path.encode())
    if cookie.expires is not None:
        seconds = math.ceil(cookie.expires) if cookie.expires > 0 else 0
        parts.append(b"Max-Age=%d" % seconds)
    if cookie.domain:
        parts.append(b"Domain=" + cookie.domain.encode())
    if cookie.http_only:
        parts.append(b"HttpOnly")
    if cookie.secure:
        parts.append(b"Secure")
    if cookie.same_site:
        parts.append(b"SameSite=" + cookie.same_site.encode())
    return b"set-cookie", b"; ".join(parts)


_VARIABLE = re.compile(r"\$([A-Za-z0-9_]+)")
_PREFIXES = ("arg_", "cookie_", "http_")
_SIMPLE = frozenset({"session_key", "remote_addr"})
# Not allowed in a field value (RFC 9110 §5.5): every control character except HTAB.
_INVALID_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _known(variable: str) -> bool:
    if variable in _SIMPLE:
        return True
    return any(variable.startswith(p) and len(variable) > len(p) for p in _PREFIXES)


def unknown_variables(template: str) -> list[str]:
    """The ``$names`` in ``template`` that :func:`expand_header_rule` does not know.

    For configuration checks: such names are kept as literal text when expanding.
    """
    return [m[0] for m in _VARIABLE.finditer(template) if not _known(m[1])]


def expand_header_rule(
    template: str,
    *,
    session_key: bytes | None,
    remote_addr: str,
    headers: Headers,
    target: bytes,
) -> bytes | None:
    """The header value of a :class:`~muxproxy.config.HeaderRule` for this request, or None.

    Variables: ``$session_key``, ``$remote_addr``, ``$arg_NAME`` (query argument,
    percent-decoded), ``$cookie_NAME``, ``$http_NAME`` (request header ``NAME`` with ``_`` as
    ``-``, case-insensitive; several fields are joined with ``, ``, cookies with ``; ``). A
    name runs to the first character not in ``[A-Za-z0-9_]``. Missing values expand to
    nothing; unknown names stay literal text. The result is stripped of surrounding spaces.
    None means "do not send this header": the result is empty, or it would not be a valid
    field value (CR, LF, NUL or another control character other than tab).
    """
    if "$" not in template:
        result = template.encode()
    else:
        headers = _as_sequence(headers)
        out: list[bytes] = []
        last = 0
        for match in _VARIABLE.finditer(template):
            out.append(template[last : match.start()].encode())
            value = _variable(match[1], session_key, remote_addr, headers, target)
            out.append(match[0].encode() if value is None else value)
            last = match.end()
        out.append(template[last:].encode())
        result = b"".join(out)
    result = result.strip(_OWS)
    if not result or _INVALID_VALUE.search(result):
        return None
    return result


def apply_header_rules(
    fields: list[tuple[bytes, bytes]],
    rules: Iterable[HeaderRule],
    *,
    session_key: bytes | None,
    remote_addr: str,
    headers: Headers,
    target: bytes,
) -> list[tuple[bytes, bytes]]:
    """``fields`` (the request head for the backend) with each rule applied in order: every
    field of the rule's name is replaced by its value (``expand_header_rule`` of the client's
    ``headers`` and ``target``), or removed where that is None."""
    headers = _as_sequence(headers)
    for rule in rules:
        name = rule.name.lower().encode("latin-1")
        value = expand_header_rule(
            rule.value,
            session_key=session_key,
            remote_addr=remote_addr,
            headers=headers,
            target=target,
        )
        fields = [(n, v) for n, v in fields if n != name]
        if value is not None:
            fields.append((name, value))
    return fields


def _variable(
    name: str,
    session_key: bytes | None,
    remote_addr: str,
    headers: Sequence[tuple[bytes, bytes]],
    target: bytes,
) -> bytes | None:
    """The value of ``$name`` (``b""`` when missing), or None for an unknown name."""
    if not _known(name):
        return None
    raw: bytes | None
    if name == "session_key":
        raw = session_key
    elif name == "remote_addr":
        raw = remote_addr.encode()
    elif name.startswith("arg_"):
        raw = query_arg(target, name[4:])
    elif name.startswith("cookie_"):
        raw = cookie_value(headers, name[7:])
    else:  # http_
        raw = _joined_header(headers, name[5:].replace("_", "-").lower().encode())
    return raw or b""


def _joined_header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    values = [value.strip(_OWS) for header, value in headers if header.lower() == name]
    if not values:
        return None
    return (b"; " if name == b"cookie" else b", ").join(values)
