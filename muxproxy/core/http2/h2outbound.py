"""The fields of a response head or trailer section as the HTTP/2 server adapter sends them:
what h2's outbound normalisation and validation did, done once per distinct field.

h2 runs every field it sends through nine generators (``normalize_outbound_headers`` and
``validate_outbound_headers``): some 1,100 bytecodes for a response head of seven fields, a
third of what sending it costs. ``h2settings`` turns both off for the client-facing connection
and ``ResponseSender`` runs each block through ``outbound_fields`` instead, which does what
they did for a server's response and trailers (RFC 9113 §8.2, §8.3):

- names lower-cased (§8.2), names and values stripped of surrounding whitespace (§8.2.1; h2's
  ``bytes.strip``);
- connection-specific fields dropped (§8.2.2: Connection, Proxy-Connection, Keep-Alive,
  Transfer-Encoding, Upgrade);
- TE other than "trailers" (§8.2.2) and any pseudo-header field (§8.3: the adapter puts the
  one a response has, :status, first itself; a trailer section has none) raise h2's
  ``ProtocolError``, as h2 did: such a field is our bug, never a peer's. So does an empty
  name, which h2 failed on too.

The fields the proxy sends are almost always already so (``headers.response_headers`` and
``trailer_fields`` make them; the exceptions are an extension's rewrites), so a field that
passed unchanged is remembered (``_KNOWN``, bounded, process-wide: the check is a function of
the field alone) and the next block with it costs one set lookup per field. Fields whose values
are new in every message (``h2encode.UNINDEXED``) are checked every time rather than
remembered, so they do not crowd the memory. The never-indexed
marking h2's normalisation also did is the encoder's (``h2encode``). Request heads to a backend
(``H2Client``) keep h2's own checks.
"""

from __future__ import annotations

import h2.exceptions

from muxproxy.core.http2.h2encode import UNINDEXED
from muxproxy.core.messages import Headers

CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade"}
)
"""RFC 9113 §8.2.2 (h2's ``CONNECTION_HEADERS``): dropped."""

KNOWN_LIMIT = 4096
"""Fields remembered as checked; past it the memory starts again (a field is at most checked
again, never wrongly passed)."""

_KNOWN: set[tuple[bytes, bytes]] = set()


def outbound_fields(fields: Headers) -> Headers:
    """``fields`` as h2 would have sent them after its outbound normalisation (see the module
    comment); raises ``h2.exceptions.ProtocolError`` where its validation did."""
    known = _KNOWN
    for field in fields:
        if field not in known:
            return _checked(fields)
    return fields


def _checked(fields: Headers) -> Headers:
    out: Headers = []
    known = _KNOWN
    for field in fields:
        if field in known:
            out.append(field)
            continue
        name, value = field
        name = name.lower().strip()
        value = value.strip()
        if name in CONNECTION_SPECIFIC:
            continue
        if not name or name[:1] == b":":
            raise h2.exceptions.ProtocolError(f"pseudo-header or empty field name: {name!r}")
        if name == b"te" and value.lower() != b"trailers":
            raise h2.exceptions.ProtocolError(f"invalid value for TE: {value!r}")
        if name == field[0] and value == field[1]:
            if name in UNINDEXED:
                out.append(field)
                continue
            if len(known) >= KNOWN_LIMIT:
                known.clear()
            known.add(field)
            out.append(field)
        else:
            out.append((name, value))
    return out
