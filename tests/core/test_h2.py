"""The HTTP/2 server adapter (core/http2/h2.py, core/http2/h2decode.py) driven through ProxyCore
with bytes only: stream errors that stay stream errors (Content-Length, trailers, header list size),
the client's GOAWAY, HPACK errors and the connection preface."""

from __future__ import annotations

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h11
import hyperframe.frame
import pytest
from playbook import H1BackendPeer, Playbook, default_config

from muxproxy.config import Limits
from muxproxy.core.commands import CloseConnection, SetTimer
from muxproxy.core.http2.h2 import PREFACE, H2Server
from muxproxy.core.messages import End, RequestHead

PROTOCOL_ERROR = h2.errors.ErrorCodes.PROTOCOL_ERROR
SSE_EVENT = b"data: tok\n\n"


class Client:
    """An h2 client peer that sends what h2 would refuse to (no outbound validation) and keeps
    what each stream received."""

    def __init__(self, pb: Playbook) -> None:
        self.pb = pb
        config = h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False
        )
        self.conn = h2.connection.H2Connection(config=config)
        self.conn.initiate_connection()
        self.seen = 0
        self.data: dict[int, bytes] = {}
        self.heads: dict[int, list[tuple[bytes, bytes]]] = {}
        self.trailers: dict[int, list[tuple[bytes, bytes]]] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.goaways: list[h2.events.ConnectionTerminated] = []

    def send(self) -> None:
        self.pb.receive(1, self.conn.data_to_send())

    def request(
        self,
        path: bytes = b"/v1/stream",
        method: bytes = b"GET",
        extra: list[tuple[bytes, bytes]] | None = None,
        *,
        end_stream: bool = True,
    ) -> int:
        sid = self.conn.get_next_available_stream_id()
        headers = [
            (b":method", method),
            (b":scheme", b"http"),
            (b":authority", b"proxy.example"),
            (b":path", path),
            *(extra or []),
        ]
        self.conn.send_headers(sid, headers, end_stream=end_stream)
        return sid

    def read(self) -> None:
        """Decode everything the proxy sent since the last call."""
        new, self.seen = self.pb.log[self.seen :], len(self.pb.log)
        for event in self.conn.receive_data(self.pb.take(1, new)):
            sid = getattr(event, "stream_id", 0)
            if isinstance(event, h2.events.ResponseReceived):
                self.heads[sid] = list(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                self.data[sid] = self.data.get(sid, b"") + event.data
                self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
            elif isinstance(event, h2.events.TrailersReceived):
                self.trailers[sid] = list(event.headers)
            elif isinstance(event, h2.events.StreamEnded):
                self.ended.add(sid)
            elif isinstance(event, h2.events.StreamReset):
                self.resets.setdefault(sid, event.error_code)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaways.append(event)

    def goaway(self) -> None:
        """Send GOAWAY(NO_ERROR) and go on reading: h2 would refuse every frame after its own
        GOAWAY, so its state machine is set back, as the proxy does for its side."""
        self.conn.close_connection()
        self.conn.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
        self.send()

    def status(self, sid: int) -> int:
        return int(dict(self.heads[sid])[b":status"])


def playbook(**limits: int) -> Playbook:
    pb = Playbook(default_config(limits=attrs.evolve(Limits(), **limits)))
    pb.accept(1)
    return pb


class Backend:
    """The HTTP/1.1 backend of one forwarded request."""

    def __init__(self, pb: Playbook, index: int) -> None:
        self.pb = pb
        self.conn = pb.opens()[index].conn
        pb.opened(self.conn)
        self.peer = H1BackendPeer()
        self.requests = [e for e in self.peer.events(pb.take(self.conn)) if hasattr(e, "target")]

    def send(self, data: bytes) -> None:
        self.pb.receive(self.conn, data)


def start_sse(pb: Playbook, client: Client) -> tuple[int, Backend]:
    """A streaming stream, its head and first event already delivered."""
    sid = client.request()
    client.send()
    backend = Backend(pb, len(pb.opens()) - 1)
    backend.send(backend.peer.sse_head() + backend.peer.chunk(SSE_EVENT))
    client.read()
    assert client.data[sid] == SSE_EVENT
    return sid, backend


def finish_sse(client: Client, sid: int, backend: Backend, events: int = 50) -> None:
    for _ in range(events):
        backend.send(backend.peer.chunk(SSE_EVENT))
        client.read()
        client.send()  # the client's WINDOW_UPDATEs
    backend.send(backend.peer.end())
    client.read()
    assert client.data[sid] == SSE_EVENT * (events + 1)
    assert sid in client.ended and sid not in client.resets


def closed(pb: Playbook) -> set[int]:
    return {c.conn for c in pb.log if isinstance(c, CloseConnection)}


# -- Content-Length (RFC 9113 §8.1.1) ---------------------------------------------------------


CONTENT_LENGTH_CASES = {
    "body-shorter": (b"10", [b"12345"]),
    "body-longer": (b"3", [b"12345"]),
    "longer-in-a-later-frame": (b"6", [b"1234", b"567"]),
    "plus-sign": (b"+5", [b"12345"]),
    "not-a-number": (b"abc", [b"12345"]),
    "no-body": (b"5", []),
}


@pytest.mark.parametrize("kind", sorted(CONTENT_LENGTH_CASES))
def test_content_length_mismatch_resets_only_its_stream(kind: str) -> None:
    pb = playbook()
    client = Client(pb)
    sse, backend = start_sse(pb, client)
    length, chunks = CONTENT_LENGTH_CASES[kind]
    bad = client.request(
        b"/v1/chat/completions", b"POST", [(b"content-length", length)], end_stream=not chunks
    )
    for i, chunk in enumerate(chunks):
        client.conn.send_data(bad, chunk, end_stream=i == len(chunks) - 1)
    client.send()  # HEADERS and DATA in one read
    client.read()
    assert client.resets.get(bad) == PROTOCOL_ERROR
    assert bad not in client.heads
    assert client.goaways == []
    # Whatever reached a backend for it was cut; the SSE stream goes on to its end.
    for index in range(1, len(pb.opens())):
        assert pb.opens()[index].conn in closed(pb)
    finish_sse(client, sse, backend)
    assert 1 not in closed(pb)


def test_body_that_matches_its_content_length_is_forwarded() -> None:
    pb = playbook()
    client = Client(pb)
    sid = client.request(
        b"/v1/chat/completions", b"POST", [(b"content-length", b"7")], end_stream=False
    )
    client.conn.send_data(sid, b"123")
    client.send()
    client.conn.send_data(sid, b"4567", end_stream=True)
    client.send()
    backend = Backend(pb, 0)
    backend.peer.events(pb.take(backend.conn))
    assert backend.peer.conn.their_state is h11.DONE
    client.read()
    assert client.resets == {} and client.goaways == []


def test_content_length_of_thousands_of_digits_is_413_on_its_stream() -> None:
    pb = playbook()
    client = Client(pb)
    sid = client.request(
        b"/v1/chat/completions", b"POST", [(b"content-length", b"1" * 5000)], end_stream=False
    )
    client.send()  # the head alone: its body is not due yet
    client.read()
    assert client.status(sid) == 413
    assert client.goaways == [] and pb.opens() == []


# -- trailers (RFC 9113 §8.1) -----------------------------------------------------------------


def test_pseudo_header_in_request_trailers_resets_the_stream() -> None:
    pb = playbook()
    client = Client(pb)
    sse, backend = start_sse(pb, client)
    bad = client.request(b"/v1/chat/completions", b"POST", end_stream=False)
    client.conn.send_data(bad, b"{}")
    client.conn.send_headers(bad, [(b":path", b"/admin")], end_stream=True)
    client.send()
    client.read()
    assert client.resets.get(bad) == PROTOCOL_ERROR
    assert client.goaways == []
    bad_backend = pb.opens()[1].conn
    assert bad_backend in closed(pb)
    finish_sse(client, sse, backend)


# -- header list size (RFC 9113 §10.5.1) --------------------------------------------------------


def test_header_list_over_the_configured_limit_gets_431_on_its_stream() -> None:
    pb = playbook(max_request_head=16384)
    client = Client(pb)
    sse, backend = start_sse(pb, client)
    big = client.request(extra=[(f"x-big-{i}".encode(), b"v" * 1000) for i in range(30)])
    client.send()
    client.read()
    assert client.status(big) == 431 and big in client.ended
    assert len(pb.opens()) == 1 and client.goaways == []
    finish_sse(client, sse, backend)


def test_header_list_within_a_large_configured_limit_is_forwarded() -> None:
    pb = playbook(max_request_head=262144)
    client = Client(pb)
    client.read()
    client.send()  # our SETTINGS acknowledged: nothing else moves the decoder's limit
    client.request(extra=[(f"x-big-{i}".encode(), b"v" * 1000) for i in range(100)])
    client.send()
    client.read()
    assert client.goaways == [] and client.resets == {}
    backend = Backend(pb, 0)
    (request,) = backend.requests
    assert sum(1 for name, _ in request.headers if name.startswith(b"x-big-")) == 100


# -- the client's GOAWAY (RFC 9113 §6.8) --------------------------------------------------------


def test_open_stream_finishes_after_the_clients_goaway() -> None:
    pb = playbook()
    client = Client(pb)
    sse, backend = start_sse(pb, client)
    client.goaway()
    finish_sse(client, sse, backend)
    assert client.goaways == []
    # Nothing is left to serve: the connection closes.
    assert 1 in closed(pb)


def test_frames_after_the_clients_goaway_in_the_same_read_are_processed() -> None:
    pb = playbook()
    client = Client(pb)
    sse, backend = start_sse(pb, client)
    # GOAWAY(NO_ERROR), then a WINDOW_UPDATE for the open stream and a PING, in one read.
    client.conn.close_connection()
    client.conn.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
    client.conn.increment_flow_control_window(1024, stream_id=sse)
    client.conn.ping(b"muxproxy")
    client.send()
    out = pb.take(1, pb.log[client.seen :])
    assert any(
        isinstance(event, h2.events.PingAckReceived) and event.ping_data == b"muxproxy"
        for event in client.conn.receive_data(out)
    )
    client.seen = len(pb.log)
    assert client.goaways == []
    finish_sse(client, sse, backend)
    assert client.goaways == []


def test_grpc_deadline_after_the_clients_goaway_is_a_trailers_only_response() -> None:
    pb = playbook()
    client = Client(pb)
    sid = client.request(
        b"/helloworld.Greeter/SayHello",
        b"POST",
        [(b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"grpc-timeout", b"1S")],
        end_stream=False,
    )
    client.conn.send_data(sid, b"\x00\x00\x00\x00\x02\x0a\x00")
    client.send()
    client.goaway()
    (deadline,) = [c for c in pb.log if isinstance(c, SetTimer) and c.timer[0] == "deadline"]
    pb.now = deadline.at
    pb.wakeup(*deadline.timer)
    client.read()
    assert client.status(sid) == 200
    assert dict(client.heads[sid])[b"grpc-status"] == b"4"  # DEADLINE_EXCEEDED
    assert sid in client.ended and client.goaways == []


# -- connection errors -------------------------------------------------------------------------


def test_undecodable_hpack_is_one_goaway_compression_error() -> None:
    pb = playbook()
    client = Client(pb)
    sse, _ = start_sse(pb, client)
    # Index 70 of an empty dynamic table: RFC 7541 §2.3.3, a decoding error.
    frame = hyperframe.frame.HeadersFrame(3, data=b"\xc6", flags=["END_HEADERS", "END_STREAM"])
    pb.receive(1, frame.serialize())
    client.read()
    assert [g.error_code for g in client.goaways] == [h2.errors.ErrorCodes.COMPRESSION_ERROR]
    assert not client.goaways[0].additional_data
    assert sse not in client.ended
    assert 1 in closed(pb)


@pytest.mark.parametrize(
    "data",
    [
        PREFACE[:16] + b"\r\nXX\r\n\r\n" + b"\x00" * 9,
        b"PRI * HTTP/2.0\r\n\r\n\r\n\r\n",
        PREFACE[:-1] + b"X",
    ],
    ids=["wrong-tail", "no-sm", "last-byte"],
)
def test_invalid_preface_on_the_plain_listener_is_goaway_protocol_error(data: bytes) -> None:
    pb = playbook()
    pb.receive(1, data)
    client = Client(pb)
    client.read()
    assert [g.error_code for g in client.goaways] == [PROTOCOL_ERROR]
    assert 1 in closed(pb) and pb.opens() == []


def test_a_request_without_a_body_ends_once() -> None:
    """h2 reports a HEADERS frame with END_STREAM as ``RequestReceived`` and then
    ``StreamEnded``: the adapter makes one ``End`` of them, not one for each."""
    server = H2Server(scheme=b"http")
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    assert server.receive(client.data_to_send()) == []
    client.receive_data(server.data_to_send())
    client.send_headers(
        1,
        [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")],
        end_stream=True,
    )
    messages = server.receive(client.data_to_send())
    assert [type(m) for m in messages] == [RequestHead, End]
    head = messages[0]
    assert isinstance(head, RequestHead) and head.end_stream and head.stream == 1
