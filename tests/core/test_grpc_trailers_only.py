"""gRPC's Trailers-Only responses from an HTTP/2 backend (``core/http/grpc.py``,
``h2client.py``, ``heads.client_head``), driven with bytes only.

A backend's Trailers-Only response (one HEADERS frame with END_STREAM, "gRPC over HTTP/2")
carries the call's status and its metadata. An HTTP/2 client gets it as it was sent, so that
grpcio reads the metadata as trailing metadata; an HTTP/1.1 client, which cannot end a
response with its head, gets the status fields as chunked trailers.
"""

from __future__ import annotations

import h2.events
from playbook import H1ClientPeer, H2Client, Playbook
from test_h2client import connect_backend, h2_config, requests

TRAILERS_ONLY = [
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-status", b"8"),
    (b"grpc-message", b"slow down"),
    (b"custom-key", b"custom-value"),
    (b"grpc-retry-pushback-ms", b"250"),
]
"""A gRPC error as a Trailers-Only response: one HEADERS frame with END_STREAM holding the
status and the call's metadata ("gRPC over HTTP/2", "Responses")."""


def test_a_trailers_only_response_reaches_an_h2_client_whole() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    sid = client.request(headers=[(b"content-type", b"application/grpc"), (b"te", b"trailers")])
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    backend.conn.send_headers(req.stream_id, TRAILERS_ONLY, end_stream=True)
    backend.flush()
    # One HEADERS frame that ends the stream: no DATA, no second HEADERS (trailers).
    of_streams = (
        h2.events.ResponseReceived,
        h2.events.DataReceived,
        h2.events.TrailersReceived,
        h2.events.StreamEnded,
    )
    events = [e for e in client.read() if isinstance(e, of_streams)]
    assert [type(e) for e in events] == [h2.events.ResponseReceived, h2.events.StreamEnded]
    (response, _) = events
    assert response.stream_id == sid and response.stream_ended is not None
    fields = dict(response.headers)
    for name, value in TRAILERS_ONLY:
        assert fields[name] == value


def test_a_trailers_only_response_reaches_an_h1_client_with_its_status_as_trailers() -> None:
    pb = Playbook(h2_config())
    h1 = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, h1.request("POST", "/x", [("te", "trailers")], body=b"{}"))
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    backend.conn.send_headers(req.stream_id, TRAILERS_ONLY, end_stream=True)
    backend.flush()
    response, *_, end = h1.events(pb.take(1))
    assert response.status_code == 200
    head = dict(response.headers)
    assert head[b"custom-key"] == b"custom-value"
    assert head[b"grpc-retry-pushback-ms"] == b"250"
    assert b"grpc-status" not in head and b"grpc-message" not in head
    assert dict(end.headers) == {b"grpc-status": b"8", b"grpc-message": b"slow down"}
