"""The HTTP/1.1 side of an h2c upgrade: which requests may switch a connection to HTTP/2.

Obeys RFC 7540 §3.2 and §3.2.1 (RFC 9113 §3.1 deprecates the mechanism, but ``curl --http2``
still uses it for ``http://`` URLs). A request offers the upgrade with ``Upgrade: h2c``,
exactly one ``HTTP2-Settings`` (the base64url payload of a SETTINGS frame) and both
``Upgrade`` and ``HTTP2-Settings`` as connection options. We accept only on a plain
connection (§3.2: h2c is for "http" URIs) and only for a request without a body: with one, the
client would have to wait for it to be read before the switch, and every client falls back
to HTTP/1.1 happily. Anything else is served over HTTP/1.1 as if no upgrade had been offered.

The switch itself (101, then an ``H2Server`` started with ``initiate_upgrade_connection``,
then the request as stream 1) is done by ``Downstream``; this module only decides.
"""

from __future__ import annotations

import base64
import binascii
import re

import attrs

from muxproxy.core.messages import Headers, RequestHead

UPGRADE_HEADERS: Headers = [(b"connection", b"Upgrade"), (b"upgrade", b"h2c")]
"""The fields of our ``101 Switching Protocols`` (RFC 7540 §3.2)."""

# RFC 7540 §3.2.1: token68 in the base64url alphabet, trailing "=" omitted (we tolerate them).
_BASE64URL = re.compile(rb"[A-Za-z0-9_-]*={0,2}")
# RFC 9113 §6.5.1: a SETTINGS payload is a list of 6-byte (identifier, value) pairs.
_SETTING_SIZE = 6


@attrs.frozen(kw_only=True)
class H2cUpgrade:
    """An accepted offer: the request that becomes stream 1, and the client's settings."""

    head: RequestHead
    settings: bytes
    """The ``HTTP2-Settings`` value, padded so that ``base64.urlsafe_b64decode`` takes it (what
    ``H2Connection.initiate_upgrade_connection`` calls)."""


def h2c_offer(head: RequestHead, *, plain: bool) -> tuple[RequestHead, H2cUpgrade | None]:
    """Look at a parsed HTTP/1.1 request for an h2c upgrade offer.

    Returns the head to use, without ``HTTP2-Settings`` when the client offered h2c (it is
    meaningful only on this hop and must not reach the backend), and the upgrade to perform,
    if it is acceptable: ``plain`` connection, no body, a valid offer.
    """
    upgrade: list[bytes] | None = None
    connection: list[bytes] = []
    settings: list[bytes] = []
    for name, value in head.headers:
        if name == b"upgrade":
            upgrade = (upgrade or []) + _tokens(value)
        elif name == b"connection":
            connection += _tokens(value)
        elif name == b"http2-settings":
            settings.append(value)
    if upgrade is None or b"h2c" not in upgrade:
        return head, None
    if settings:
        head = attrs.evolve(head, headers=[f for f in head.headers if f[0] != b"http2-settings"])
    if (
        not plain
        or not head.end_stream
        or len(settings) != 1
        or b"upgrade" not in connection
        or b"http2-settings" not in connection
    ):
        return head, None
    payload = _decode_settings(settings[0])
    if payload is None:
        return head, None
    return head, H2cUpgrade(head=head, settings=payload)


def _decode_settings(value: bytes) -> bytes | None:
    value = value.strip(b" \t")
    if _BASE64URL.fullmatch(value) is None:
        return None
    padded = value.rstrip(b"=")
    padded += b"=" * (-len(padded) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded)
    except (binascii.Error, ValueError):
        return None
    if len(raw) % _SETTING_SIZE:
        return None
    return padded


def _tokens(value: bytes) -> list[bytes]:
    return [token.strip(b" \t").lower() for token in value.split(b",")]
