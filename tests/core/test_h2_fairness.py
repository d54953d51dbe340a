"""Streams that share a connection window share it: round robin over the blocked streams."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events

from muxproxy.core.http2.h2 import H2Server
from muxproxy.core.http2.h2send import BlockedStreams
from muxproxy.core.messages import ResponseHead

STREAMS = (1, 3, 5, 7)
BODY = b"x" * 200_000  # each: far more than the 65,535-byte connection window


def test_blocked_streams_rotate():
    blocked = BlockedStreams()
    for sid in (1, 3, 5):
        blocked.add(sid)
    blocked.add(1)  # already waiting: keeps its place
    assert blocked.in_order() == [1, 3, 5]
    blocked.served(1)
    assert blocked.in_order() == [3, 5, 1]
    blocked.discard(3)
    blocked.served(3)  # not waiting: nothing to move
    assert blocked.in_order() == [5, 1]


def test_every_stream_gets_a_share_of_the_connection_window():
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.local_settings.initial_window_size = 1 << 20  # streams are not the limit
    client.initiate_connection()
    for sid in STREAMS:
        headers = [(":method", "GET"), (":scheme", "http"), (":authority", "a"), (":path", "/")]
        client.send_headers(sid, headers, end_stream=True)
    server = H2Server(scheme=b"http")
    server.receive(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive(client.data_to_send())  # the SETTINGS ack carrying the stream windows
    for sid in STREAMS:
        server.send_head(ResponseHead(stream=sid, status=200, headers=[]))
        server.send_body(sid, BODY)
    received = dict.fromkeys(STREAMS, 0)
    # The client's connection window opens 8 KiB at a time, as a slow reader's would.
    for _ in range(4):
        for event in client.receive_data(server.data_to_send()):
            if isinstance(event, h2.events.DataReceived):
                received[event.stream_id] += event.flow_controlled_length
        client.increment_flow_control_window(8192)
        server.receive(client.data_to_send())
        server.flush_blocked()
    # Stream 1 had the whole open window to itself before the others queued anything; what
    # the WINDOW_UPDATEs opened afterwards went round: no stream starved.
    assert all(received.values()), received
    later = [received[sid] for sid in STREAMS[1:]]
    assert max(later) - min(later) <= 16384, received
