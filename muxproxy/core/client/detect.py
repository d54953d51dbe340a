"""Which protocol a client connection speaks, and the adapter that speaks it.

Obeys RFC 9113 §3.3 and §3.4: over TLS the ALPN result decides; on a plain listener a
connection that starts with the HTTP/2 connection preface speaks h2c (prior knowledge),
anything else HTTP/1.1. A connection that starts like the preface (``PRI * HTTP/2.0``, which no
HTTP/1.1 request line can be, RFC 9112 §2.3) but is not it is HTTP/2 with an invalid preface:
the adapter answers GOAWAY(PROTOCOL_ERROR) (§3.4), not an HTTP/1.1 400; so does the exact
preface followed by a frame other than SETTINGS (``h2preface.py``). And RFC 7540 §3.2 for
the h2c upgrade: whether an offer is acceptable is ``h2c.py``'s; here the HTTP/2 side of the
switch is built from the offer's settings, or refused when h2 refuses them.

The decisions are functions of bytes and configuration, so they are tested without sockets;
``Downstream`` takes them as inputs of its table (``downstream_states.py``: H1, H2, H2C) and
does the switch itself, since it owns the connection's output.
"""

from __future__ import annotations

import attrs
import h2.exceptions

from muxproxy.core.client.downstream_states import Protocol
from muxproxy.core.effects import Effects
from muxproxy.core.http1.h1 import H1Server
from muxproxy.core.http1.h2c import H2cUpgrade
from muxproxy.core.http2.h2 import PREFACE, H2Server
from muxproxy.core.messages import End, Message

PREFACE_LINE = PREFACE[:14]
"""RFC 9113 §3.4: the preface's first line; no HTTP/1.1 request line reads so."""


def by_alpn(alpn: str | None) -> Protocol:
    """The protocol of a TLS connection: ``h2`` if ALPN chose it, else HTTP/1.1 (RFC 9113
    §3.3; a client that offers no ALPN speaks HTTP/1.1)."""
    return Protocol.HTTP2 if alpn == "h2" else Protocol.HTTP1


def sniff(first: bytes) -> Protocol | None:
    """The protocol the first bytes of a plain connection announce; None while they are a
    proper start of the preface (too few to tell)."""
    if len(first) < len(PREFACE) and PREFACE.startswith(first):
        return None
    # h2 checks the rest of the preface and answers an invalid one with a GOAWAY.
    return Protocol.HTTP2 if first.startswith(PREFACE_LINE) else Protocol.HTTP1


def h1_server(fx: Effects, scheme: bytes) -> H1Server:
    return H1Server(scheme=scheme, max_head=fx.config.limits.max_request_head)


def h2_server(fx: Effects, scheme: bytes, upgrade_settings: bytes | None = None) -> H2Server:
    """The HTTP/2 side of a connection. Raises h2's ``ProtocolError`` if ``upgrade_settings``
    (an h2c offer's) are out of range (RFC 9113 §6.5.2)."""
    limits = fx.config.limits
    # A stream's receive window is what a client may send beyond what we hold; the
    # request side stays within stream_buffer only if it fits in one read's slack.
    return H2Server(
        scheme=scheme,
        max_concurrent_streams=limits.max_concurrent_streams,
        initial_window=min(65535, fx.read_size),
        max_header_list_size=limits.max_request_head,
        connection_window=limits.h2_connection_window,
        upgrade_settings=upgrade_settings,
        reset_budget=limits.h2_reset_budget,
        control_budget=limits.h2_control_frame_budget,
        watch=fx,
    )


def h2c_server(fx: Effects, scheme: bytes, offer: H2cUpgrade) -> H2Server | None:
    """The HTTP/2 side of an accepted h2c offer, or None when h2 refuses its settings: the
    request is then served over HTTP/1.1."""
    try:
        return h2_server(fx, scheme, offer.settings)
    except h2.exceptions.ProtocolError:
        return None


def switch_to_h2c(h1: H1Server) -> tuple[bytes, list[Message], bytes]:
    """Take ``h1``'s pending h2c offer: our 101's bytes, the offer's request as stream 1 of
    the HTTP/2 connection (its head and end), and what the client sent after the request,
    the start of its HTTP/2 preface. ``h1`` is done with the connection."""
    offer = h1.h2c
    assert offer is not None
    switched, rest = h1.switch_to_h2c()
    return switched, [attrs.evolve(offer.head, stream=1), End(stream=1)], rest
