"""``HeaderEncoder``: RFC 7541 header blocks that hpack's own decoder reads back field for
field, with the dynamic table kept in step across blocks, and the indexing rules of the module
comment (request ids without indexing, secrets never indexed)."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import hpack
import hpack.huffman
import hpack.huffman_constants
from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.core.http2.h2 import H2Server
from muxproxy.core.http2.h2encode import MAX_TABLE_SIZE, STATIC_TABLE, UNINDEXED, HeaderEncoder
from muxproxy.core.http2.h2huffman import huffman_or_raw
from muxproxy.core.messages import ResponseHead
from muxproxy.core.observe.access import REQUEST_ID
from muxproxy.core.observe.tracecontext import TRACEPARENT

HEAD = [
    (b":status", b"200"),
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"via", b"1.1 muxproxy"),
    (b"date", b"Mon, 07 Dec 2026 14:36:18 GMT"),
    (b"x-accel-buffering", b"no"),
]

NAMES = st.sampled_from(
    [b"content-type", b"x-request-id", b"date", b"authorization", b"cookie", b"x-a", b":status"]
    + [name for name, _ in STATIC_TABLE[:20]]
)
VALUES = st.one_of(
    st.sampled_from([b"", b"200", b"text/event-stream", b"GET", b"no-cache"]),
    st.binary(max_size=40),
    st.binary(min_size=1000, max_size=3100),
)
FIELD = st.tuples(NAMES, VALUES, st.sampled_from(["pair", "never", "triple"]))
STEP = st.one_of(
    st.lists(FIELD, max_size=10),
    st.sampled_from([0, 64, 300, 4096, 8192, 1 << 20]),
)


def as_field(
    name: bytes, value: bytes, kind: str
) -> tuple[bytes, bytes] | tuple[bytes, bytes, bool] | hpack.NeverIndexedHeaderTuple:
    if kind == "never":
        return hpack.NeverIndexedHeaderTuple(name, value)
    if kind == "triple":
        return (name, value, True)
    return (name, value)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=40), st.booleans())
def test_every_block_decodes_to_its_fields_with_the_tables_in_step(
    steps: list[list[tuple[bytes, bytes, str]] | int], huffman: bool
) -> None:
    encoder, decoder = HeaderEncoder(), hpack.Decoder()
    for step in steps:
        if isinstance(step, int):
            # SETTINGS_HEADER_TABLE_SIZE from the peer: its decoder allows that much.
            encoder.header_table_size = step
            decoder.max_allowed_table_size = step
            continue
        fields = [as_field(*field) for field in step]
        decoded = decoder.decode(encoder.encode(fields, huffman=huffman), raw=True)
        assert [(bytes(n), bytes(v)) for n, v in decoded] == [(f[0], f[1]) for f in fields]
        assert encoder.size == sum(entry[3] for entry in encoder.entries) <= encoder.max_size
        assert encoder.max_size <= MAX_TABLE_SIZE


def test_a_repeated_head_is_one_octet_per_field() -> None:
    encoder = HeaderEncoder()
    first = encoder.encode(HEAD)
    assert len(first) > len(HEAD)
    # RFC 7541 §2.3.3: :status 200 is static entry 8; the five others were added in order,
    # so the first of them is the oldest dynamic entry (66) and the last the newest (62).
    assert encoder.encode(HEAD) == bytes([0x88, 0xC2, 0xC1, 0xC0, 0xBF, 0xBE])


def test_request_ids_do_not_push_the_repeated_fields_out_of_the_table() -> None:
    encoder, decoder = HeaderEncoder(), hpack.Decoder()
    for n in range(500):
        request_id = b"c7f35a2f7dd9-%d" % n
        block = encoder.encode([*HEAD, (b"x-request-id", request_id)])
        assert list(decoder.decode(block, raw=True))[-1] == (b"x-request-id", request_id)
    # The six fields stay one octet each; the id is a literal without indexing (§6.2.2:
    # 0000 then its name as a literal), and the table holds the head's five entries only.
    assert block[:6] == bytes([0x88, 0xC2, 0xC1, 0xC0, 0xBF, 0xBE])
    assert block[6] == 0x00
    assert len(encoder.entries) == 5


def test_the_unindexed_names_are_the_ones_the_proxy_sets() -> None:
    assert {REQUEST_ID, TRACEPARENT} == UNINDEXED


def test_secrets_are_never_indexed_and_stay_out_of_the_table() -> None:
    encoder, decoder = HeaderEncoder(), hpack.Decoder()
    fields = [
        (b"authorization", b"Bearer sk-0123"),
        (b"cookie", b"id=1"),
        hpack.NeverIndexedHeaderTuple(b"x-secret", b"s"),
        (b"cookie", b"a-long-cookie=0123456789abcdef"),
    ]
    for _ in range(2):
        decoded = decoder.decode(encoder.encode(fields))
    never = [isinstance(field, hpack.NeverIndexedHeaderTuple) for field in decoded]
    assert never == [True, True, True, False]
    assert [entry[1] for entry in encoder.entries] == [b"cookie"]


def test_a_smaller_table_is_signalled_smallest_first_then_the_last_size() -> None:
    encoder, decoder = HeaderEncoder(), hpack.Decoder()
    decoder.decode(encoder.encode(HEAD))
    encoder.header_table_size = 0
    encoder.header_table_size = 300
    block = encoder.encode(HEAD)
    # RFC 7541 §6.3: 001 then the size in a 5-bit prefix: 0, then 300 (31 + 269 in 7-bit groups).
    assert block[:4] == bytes([0x20, 0x3F, 0x8D, 0x02])
    decoder.max_allowed_table_size = 300
    assert decoder.decode(block, raw=True) == HEAD
    assert decoder.header_table_size == 300


def test_huffman_only_where_it_is_shorter() -> None:
    reference = hpack.huffman.HuffmanEncoder(
        hpack.huffman_constants.REQUEST_CODES, hpack.huffman_constants.REQUEST_CODES_LENGTH
    )
    for value in (b"text/event-stream", b"Mon, 07 Dec 2026 14:36:18 GMT", b"x"):
        coded, octets = huffman_or_raw(value)
        assert octets == (reference.encode(value) if coded else value)
        assert len(octets) <= len(value)
    assert huffman_or_raw(bytes(range(256))) == (False, bytes(range(256)))


def test_an_h2_client_reads_the_responses_of_h2server() -> None:
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    client.initiate_connection()
    request = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    streams = [1, 3, 5]
    for sid in streams:
        client.send_headers(sid, request, end_stream=True)
    server = H2Server(scheme=b"http")
    server.receive(client.data_to_send())
    for sid in streams:
        fields = [*HEAD[1:], (b"x-request-id", b"id-%d" % sid)]
        server.send_head(ResponseHead(stream=sid, status=200, headers=fields), end_stream=True)
    events = client.receive_data(server.data_to_send())
    heads = [e.headers for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert heads == [[*HEAD, (b"x-request-id", b"id-%d" % sid)] for sid in streams]
