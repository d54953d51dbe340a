"""The HTTP/2 server adapter (core/http2/h2.py, core/http2/h2decode.py) driven through ProxyCore
with bytes only, as whole conversations: stream errors that stay stream errors (Content-Length,
trailers, header list size), the client's GOAWAY, HPACK errors and the connection preface.
Every command is asserted in order, timers included; what the proxy sends the client is decoded
by a real h2 client peer, what it sends a backend by a real h11 server peer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h11
import hyperframe.frame
import pytest
from checks import Check, both, h1_request, h2_body, h2_ended, h2_resets, h2_response, on_stream
from playbook import H1BackendPeer, Playbook, Sends, data, default_config, opened, wakeup

from muxproxy.config import Limits
from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, Origin, SetTimer
from muxproxy.core.http2.h2 import PREFACE, H2Server
from muxproxy.core.messages import End, RequestHead

PROTOCOL_ERROR = h2.errors.ErrorCodes.PROTOCOL_ERROR
NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
SSE_EVENT = b"data: tok\n\n"
ORIGIN = Origin(host="127.0.0.1", port=9001)


class Client:
    """An h2 client peer that sends what h2 would refuse to (no outbound validation) and keeps
    what each stream received (``events`` decodes for ``Sends``)."""

    def __init__(self) -> None:
        config = h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False
        )
        self.conn = h2.connection.H2Connection(config=config)
        self.conn.initiate_connection()
        self.data: dict[int, bytes] = {}
        self.heads: dict[int, list[tuple[bytes, bytes]]] = {}
        self.trailers: dict[int, list[tuple[bytes, bytes]]] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.goaways: list[h2.events.ConnectionTerminated] = []

    def output(self) -> bytes:
        """What this peer has to send: ``pb >> data(1, client.output())``."""
        return self.conn.data_to_send()

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

    def events(self, data: bytes) -> list[h2.events.Event]:
        """Decode ``data`` from the proxy and keep what each stream got."""
        events = self.conn.receive_data(data)
        for event in events:
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
        return events

    def goaway(self) -> bytes:
        """GOAWAY(NO_ERROR), going on reading: h2 would refuse every frame after its own
        GOAWAY, so its state machine is set back, as the proxy does for its side."""
        self.conn.close_connection()
        self.conn.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
        return self.output()

    def status(self, sid: int) -> int:
        return int(dict(self.heads[sid])[b":status"])


def playbook(**limits: int) -> Playbook:
    pb = Playbook(default_config(limits=attrs.evolve(Limits(), **limits)))
    pb.accept(1)  # set-up: its header timer is not asserted
    return pb


# -- checks on what the client decoded --------------------------------------------------------


def settings(events: Sequence[Any]) -> None:
    """The proxy's SETTINGS, and nothing for any stream."""
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events), events
    assert not [e for e in events if getattr(e, "stream_id", 0)], events


def acked(events: Sequence[Any]) -> None:
    """The proxy acknowledged the client's SETTINGS, and nothing for any stream."""
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events), events
    assert not [e for e in events if getattr(e, "stream_id", 0)], events


def refused(sid: int) -> Check:
    """Stream ``sid`` reset with PROTOCOL_ERROR and given no response head; no GOAWAY."""

    def check(events: Sequence[Any]) -> None:
        assert not [e for e in on_stream(events, sid) if isinstance(e, h2.events.ResponseReceived)]

    return both(h2_resets((sid, PROTOCOL_ERROR)), check)


def event_on(sid: int) -> Check:
    """One SSE event on stream ``sid``, which goes on."""
    return lambda events: h2_body(events, sid) == SSE_EVENT and not on_stream(events, sid)[1:]


def no_goaway(events: Sequence[Any]) -> None:
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events), events


def goaway(code: int) -> Check:
    """One GOAWAY with ``code`` and no debug data."""

    def check(events: Sequence[Any]) -> None:
        (terminated,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert terminated.error_code == code and not terminated.additional_data, terminated

    return check


# -- the conversation's steps -----------------------------------------------------------------


def start_sse(pb: Playbook, client: Client) -> tuple[int, H1BackendPeer]:
    """The client's preface and a GET of /v1/stream in one read (exchange 1); backend
    connection -1 answers with an SSE head and one event, relayed on the stream."""
    sid = client.request()
    pb >> data(1, client.output())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << Sends(1, client, acked)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, h1_request(b"GET", b"/v1/stream"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> data(-1, backend.sse_head() + backend.chunk(SSE_EVENT))
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200, b"", ended=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, event_on(sid))
    assert client.data[sid] == SSE_EVENT
    return sid, backend


def finish_sse(
    pb: Playbook, client: Client, sid: int, backend: H1BackendPeer, events: int = 50
) -> None:
    """``events`` more SSE events and the end of the response, relayed one by one; the
    backend connection goes back to the pool (the caller asserts what follows)."""
    for _ in range(events):
        pb >> data(-1, backend.chunk(SSE_EVENT))
        pb << Sends(1, client, event_on(sid))
        if update := client.output():  # the client's WINDOW_UPDATEs
            pb >> data(1, update)
    pb >> data(-1, backend.end())
    pb << Sends(1, client, h2_ended(sid))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    assert client.data[sid] == SSE_EVENT * (events + 1)
    assert sid in client.ended and sid not in client.resets


def cut(pb: Playbook, *, ex: int, up: int) -> None:
    """What reached backend connection ``up`` for exchange ``ex`` is cut."""
    pb << CloseConnection(conn=up)
    pb << CancelTimer(timer=("connect", ex))
    pb << CancelTimer(timer=("body", ex))


# -- Content-Length (RFC 9113 §8.1.1) ---------------------------------------------------------

# kind: (content-length, DATA frames, how its exchange (2) ends: "refused" before it is
# forwarded; "reset-then-cut" or "cut-then-reset": its backend connection (-2) was opened).
CONTENT_LENGTH_CASES = {
    "body-shorter": (b"10", [b"12345"], "reset-then-cut"),
    "body-longer": (b"3", [b"12345"], "cut-then-reset"),
    "longer-in-a-later-frame": (b"6", [b"1234", b"567"], "reset-then-cut"),
    "plus-sign": (b"+5", [b"12345"], "refused"),
    "not-a-number": (b"abc", [b"12345"], "refused"),
    "no-body": (b"5", [], "refused"),
}


@pytest.mark.parametrize("kind", sorted(CONTENT_LENGTH_CASES))
def test_content_length_mismatch_resets_only_its_stream(kind: str) -> None:
    pb = playbook()
    client = Client()
    sse, backend = start_sse(pb, client)
    length, chunks, ending = CONTENT_LENGTH_CASES[kind]
    bad = client.request(
        b"/v1/chat/completions", b"POST", [(b"content-length", length)], end_stream=not chunks
    )
    for i, chunk in enumerate(chunks):
        client.conn.send_data(bad, chunk, end_stream=i == len(chunks) - 1)
    pb >> data(1, client.output())  # HEADERS and DATA in one read
    if ending != "refused":
        pb << SetTimer(timer=("connect", 2), at=5.0)
        pb << OpenConnection(conn=-2, origin=ORIGIN)
        pb << SetTimer(timer=("body", 2), at=30.0)
    if ending == "cut-then-reset":
        cut(pb, ex=2, up=-2)
    pb << Sends(1, client, refused(bad))
    if ending == "reset-then-cut":
        cut(pb, ex=2, up=-2)
    assert client.resets.get(bad) == PROTOCOL_ERROR
    assert bad not in client.heads
    assert client.goaways == []
    # The SSE stream goes on to its end; client connection 1 stays open.
    finish_sse(pb, client, sse, backend)
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_body_that_matches_its_content_length_is_forwarded() -> None:
    pb = playbook()
    client = Client()
    sid = client.request(
        b"/v1/chat/completions", b"POST", [(b"content-length", b"7")], end_stream=False
    )
    client.conn.send_data(sid, b"123")
    pb >> data(1, client.output())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb << Sends(1, client, acked)
    client.conn.send_data(sid, b"4567", end_stream=True)
    pb >> data(1, client.output())  # the rest of the body waits for the backend
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, h1_request(b"POST", b"/v1/chat/completions", b"1234567"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb.done()
    assert backend.conn.their_state is h11.DONE
    assert client.resets == {} and client.goaways == []


def test_content_length_of_thousands_of_digits_is_413_on_its_stream() -> None:
    pb = playbook()
    client = Client()
    sid = client.request(
        b"/v1/chat/completions", b"POST", [(b"content-length", b"1" * 5000)], end_stream=False
    )
    pb >> data(1, client.output())  # the head alone: its body is not due yet
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, both(preface_acked, h2_response(sid, 413), no_goaway))
    pb.done()  # no OpenConnection
    assert client.status(sid) == 413
    assert client.goaways == []


def preface_acked(events: Sequence[Any]) -> None:
    """The proxy's SETTINGS and its acknowledgement of the client's."""
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events), events
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events), events


# -- trailers (RFC 9113 §8.1) -----------------------------------------------------------------


def test_pseudo_header_in_request_trailers_resets_the_stream() -> None:
    pb = playbook()
    client = Client()
    sse, backend = start_sse(pb, client)
    bad = client.request(b"/v1/chat/completions", b"POST", end_stream=False)
    client.conn.send_data(bad, b"{}")
    client.conn.send_headers(bad, [(b":path", b"/admin")], end_stream=True)
    pb >> data(1, client.output())
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb << SetTimer(timer=("body", 2), at=30.0)
    pb << Sends(1, client, refused(bad))
    cut(pb, ex=2, up=-2)  # its backend connection is closed
    assert client.resets.get(bad) == PROTOCOL_ERROR
    assert client.goaways == []
    finish_sse(pb, client, sse, backend)
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


# -- header list size (RFC 9113 §10.5.1) --------------------------------------------------------


def test_header_list_over_the_configured_limit_gets_431_on_its_stream() -> None:
    pb = playbook(max_request_head=16384)
    client = Client()
    sse, backend = start_sse(pb, client)
    big = client.request(extra=[(f"x-big-{i}".encode(), b"v" * 1000) for i in range(30)])
    pb >> data(1, client.output())
    pb << Sends(1, client, both(h2_response(big, 431, ended=True), no_goaway))
    assert client.status(big) == 431 and big in client.ended
    assert client.goaways == []
    finish_sse(pb, client, sse, backend)  # no second OpenConnection
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_header_list_within_a_large_configured_limit_is_forwarded() -> None:
    pb = playbook(max_request_head=262144)
    client = Client()
    pb >> data(1, client.output())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, preface_acked)
    # Our SETTINGS acknowledged (with the request): nothing else moves the decoder's limit.
    client.request(extra=[(f"x-big-{i}".encode(), b"v" * 1000) for i in range(100)])
    pb >> data(1, client.output())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    assert client.goaways == [] and client.resets == {}
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (forwarded := Sends(-1, backend, h1_request(b"GET", b"/v1/stream")))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb.done()
    (request, _) = forwarded.events
    assert sum(1 for name, _ in request.headers if name.startswith(b"x-big-")) == 100


# -- the client's GOAWAY (RFC 9113 §6.8) --------------------------------------------------------


def test_open_stream_finishes_after_the_clients_goaway() -> None:
    pb = playbook()
    client = Client()
    sse, backend = start_sse(pb, client)
    pb >> data(1, client.goaway())
    finish_sse(pb, client, sse, backend)
    # Nothing is left to serve: the connection closes.
    pb << CloseConnection(conn=1)
    pb.done()
    assert client.goaways == []


def test_frames_after_the_clients_goaway_in_the_same_read_are_processed() -> None:
    pb = playbook()
    client = Client()
    sse, backend = start_sse(pb, client)
    # GOAWAY(NO_ERROR), then a WINDOW_UPDATE for the open stream and a PING, in one read.
    client.conn.close_connection()
    client.conn.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
    client.conn.increment_flow_control_window(1024, stream_id=sse)
    client.conn.ping(b"muxproxy")
    pb >> data(1, client.output())
    pb << Sends(1, client, pinged_back)
    assert client.goaways == []
    finish_sse(pb, client, sse, backend)
    pb << CloseConnection(conn=1)
    pb.done()
    assert client.goaways == []


def pinged_back(events: Sequence[Any]) -> bool:
    """The PING acknowledged with its data."""
    return any(
        isinstance(event, h2.events.PingAckReceived) and event.ping_data == b"muxproxy"
        for event in events
    )


def test_grpc_deadline_after_the_clients_goaway_is_a_trailers_only_response() -> None:
    pb = playbook()
    client = Client()
    sid = client.request(
        b"/helloworld.Greeter/SayHello",
        b"POST",
        [(b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"grpc-timeout", b"1S")],
        end_stream=False,
    )
    client.conn.send_data(sid, b"\x00\x00\x00\x00\x02\x0a\x00")
    pb >> data(1, client.output())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("deadline", 1), at=1.0)
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb << Sends(1, client, acked)
    pb >> data(1, client.goaway())
    pb.now = 1.0
    pb >> wakeup("deadline", 1)
    pb << CancelTimer(timer=("connect", 1))
    pb << CloseConnection(conn=-1)
    pb << Sends(1, client, h2_response(sid, 200, b"", ended=True))
    pb << CancelTimer(timer=("body", 1))
    pb << Sends(1, client, h2_resets((sid, NO_ERROR)))  # the rest of the request is not wanted
    pb << CloseConnection(conn=1)
    pb.done()
    assert dict(client.heads[sid])[b"grpc-status"] == b"4"  # DEADLINE_EXCEEDED
    assert sid in client.ended and client.goaways == []


# -- connection errors -------------------------------------------------------------------------


def test_undecodable_hpack_is_one_goaway_compression_error() -> None:
    pb = playbook()
    client = Client()
    sse, _ = start_sse(pb, client)
    # Index 70 of an empty dynamic table: RFC 7541 §2.3.3, a decoding error.
    frame = hyperframe.frame.HeadersFrame(3, data=b"\xc6", flags=["END_HEADERS", "END_STREAM"])
    pb >> data(1, frame.serialize())
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << Sends(1, client, goaway(h2.errors.ErrorCodes.COMPRESSION_ERROR))
    pb << CloseConnection(conn=1)
    pb.done()
    assert sse not in client.ended


@pytest.mark.parametrize(
    "data_",
    [
        PREFACE[:16] + b"\r\nXX\r\n\r\n" + b"\x00" * 9,
        b"PRI * HTTP/2.0\r\n\r\n\r\n\r\n",
        PREFACE[:-1] + b"X",
    ],
    ids=["wrong-tail", "no-sm", "last-byte"],
)
def test_invalid_preface_on_the_plain_listener_is_goaway_protocol_error(data_: bytes) -> None:
    pb = playbook()
    client = Client()
    pb >> data(1, data_)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, goaway(PROTOCOL_ERROR))
    pb << CloseConnection(conn=1)
    pb.done()  # no OpenConnection


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
