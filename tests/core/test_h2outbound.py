"""``outbound_fields``: a response's fields as h2's own outbound normalisation and validation
made them (h2 the oracle), so that turning those off on the client-facing connection changes
nothing on the wire."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.utilities
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.core.http2 import h2outbound
from muxproxy.core.http2.h2 import H2Server
from muxproxy.core.http2.h2outbound import outbound_fields
from muxproxy.core.messages import Headers, ResponseHead

NAMES = st.sampled_from(
    [
        b"content-type",
        b"Content-Type",
        b" x-padded ",
        b"x-request-id",
        b"connection",
        b"Transfer-Encoding",
        b"keep-alive",
        b"upgrade",
        b"te",
        b"TE",
        b":path",
        b":status",
        b"",
        b"via",
    ]
)
VALUES = st.sampled_from([b"", b"trailers", b"Trailers", b"gzip", b" padded\t", b"no-cache", b"1"])


def h2s(fields: Headers, *, trailer: bool) -> Headers | type[Exception]:
    """What h2 (normalisation and validation on) makes of a response head or trailers."""
    flags = h2.utilities.HeaderValidationFlags(
        is_client=False, is_trailer=trailer, is_response_header=not trailer, is_push_promise=False
    )
    block = fields if trailer else [(b":status", b"200"), *fields]
    try:
        out = h2.utilities.validate_outbound_headers(
            h2.utilities.normalize_outbound_headers(block, flags), flags
        )
        return [(bytes(name), bytes(value)) for name, value in out]
    except (h2.exceptions.ProtocolError, IndexError):  # IndexError: h2 on an empty name
        return h2.exceptions.ProtocolError


def ours(fields: Headers, *, trailer: bool) -> Headers | type[Exception]:
    try:
        out = outbound_fields(fields)
    except h2.exceptions.ProtocolError:
        return h2.exceptions.ProtocolError
    return out if trailer else [(b":status", b"200"), *out]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(NAMES, VALUES), max_size=6), st.booleans(), st.booleans())
def test_fields_come_out_as_h2s_normalisation_made_them(
    fields: list[tuple[bytes, bytes]], trailer: bool, fresh: bool
) -> None:
    if fresh:
        h2outbound._KNOWN.clear()  # checked from scratch, or with what earlier examples left
    assert ours(fields, trailer=trailer) == h2s(fields, trailer=trailer)
    # A second time, with the fields that passed remembered: the same answer.
    assert ours(fields, trailer=trailer) == h2s(fields, trailer=trailer)


def test_the_memory_of_checked_fields_is_bounded() -> None:
    h2outbound._KNOWN.clear()
    for n in range(h2outbound.KNOWN_LIMIT + 10):
        assert outbound_fields([(b"x-n", b"%d" % n)]) == [(b"x-n", b"%d" % n)]
    assert len(h2outbound._KNOWN) <= h2outbound.KNOWN_LIMIT
    outbound_fields([(b"x-request-id", b"once")])
    assert (b"x-request-id", b"once") not in h2outbound._KNOWN


def test_a_client_gets_an_extensions_fields_normalised_as_before() -> None:
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    client.initiate_connection()
    request = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    client.send_headers(1, request, end_stream=True)
    server = H2Server(scheme=b"http")
    server.receive(client.data_to_send())
    fields = [
        (b"X-Upper", b" padded "),
        (b"connection", b"close"),
        (b"content-type", b"text/plain"),
    ]
    server.send_head(ResponseHead(stream=1, status=200, headers=fields))
    server.send_end(1, [(b"X-Trailer", b"1 "), (b"keep-alive", b"5")])
    events = client.receive_data(server.data_to_send())
    head = next(e for e in events if isinstance(e, h2.events.ResponseReceived))
    trailers = next(e for e in events if isinstance(e, h2.events.TrailersReceived))
    assert head.headers == [
        (b":status", b"200"),
        (b"x-upper", b"padded"),
        (b"content-type", b"text/plain"),
    ]
    assert trailers.headers == [(b"x-trailer", b"1")]


def test_a_pseudo_header_among_the_fields_is_our_bug_as_h2_said() -> None:
    with pytest.raises(h2.exceptions.ProtocolError):
        outbound_fields([(b"x-a", b"1"), (b":path", b"/")])
    with pytest.raises(h2.exceptions.ProtocolError):
        outbound_fields([(b"te", b"gzip")])
