"""``core/client/downstream.py`` as whole conversations: one client connection and its timers.

The rules under test: HTTP/1.1 requests on a kept-alive connection are served one after the
other (RFC 9112 §9.3), pipelined ones too; an idle connection closes after
``keepalive_idle``; the first byte of the next request starts the ``client_header`` deadline
(408, RFC 9110 §15.5.9); a client that stops reading is cut by the send timeout, which is
lazy (progress moves it); a connection that starts like the HTTP/2 preface but is not it gets
GOAWAY(PROTOCOL_ERROR), not an HTTP/1.1 400 (RFC 9113 §3.4).
"""

from __future__ import annotations

import h2.errors
import h2.events
import h11
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    is_request,
    opened,
    sent,
    subset,
    wakeup,
)

from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    Origin,
    SendData,
    SetTimer,
)

ORIGIN = Origin(host="127.0.0.1", port=9001)


def served_once(pb: Playbook, client: H1ClientPeer, backend: H1BackendPeer) -> None:
    """One request on client connection 1, answered and written out whole by t=0."""
    pb.accept(1)
    pb.receive(1, client.request("GET", "/one"))
    pb.opened(-1)
    backend.events(pb.take(-1))
    pb.receive(-1, backend.reply(b"x"))
    client.events(pb.take(1))
    pb.sent(1, len(pb.take(1)))
    client.conn.start_next_cycle()
    backend.conn.start_next_cycle()


def test_pipelined_requests_are_served_one_after_the_other() -> None:
    pb = Playbook()
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    first = client.request("GET", "/one")
    pb >> data(1, first + b"GET /two HTTP/1.1\r\nHost: proxy.example\r\n\r\n")
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb.done()  # /two waits for /one's response: no second connect
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, is_request(b"/one"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> data(-1, backend.reply(b"1"))
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, lambda events: events[0].status_code == 200)
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << SendData(conn=1, data=b"1")
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    # /one is done: /two starts now, on the connection /one just gave back.
    pb << SetTimer(timer=("header", 1), at=30.0)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 2))
    backend.conn.start_next_cycle()
    pb << Sends(-1, backend, is_request(b"/two"))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb.done()


def test_an_idle_kept_alive_connection_closes_after_keepalive_idle() -> None:
    pb = Playbook()
    client, backend = H1ClientPeer(), H1BackendPeer()
    served_once(pb, client, backend)
    pb.now = 75.0
    pb >> wakeup("idle", 1)
    pb << CloseConnection(conn=1)
    pb.done()
    pb >> closed(1)
    pb << CancelTimer(timer=("send", 1))  # the only one still armed
    pb.done()  # the pooled backend connection stays for other clients


def test_the_first_byte_of_the_next_request_starts_the_header_deadline() -> None:
    pb = Playbook(ignore=())
    client, backend = H1ClientPeer(), H1BackendPeer()
    served_once(pb, client, backend)
    pb.now = 10.0
    pb >> data(1, b"GET /two HT")
    # keepalive_idle no longer bounds it: the client is sending a request.
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("header", 1), at=40.0)
    pb.now = 40.0
    pb >> wakeup("header", 1)
    pb << Log(event="request_header_timeout", fields=subset({"conn": 1}))
    response = Sends(1, client)
    pb << response
    pb << CloseConnection(conn=1)
    pb.done()
    (head, *_) = response.events
    assert isinstance(head, h11.Response)
    assert head.status_code == 408
    assert (b"connection", b"close") in head.headers


def test_a_client_that_stops_reading_is_cut_by_the_lazy_send_timeout() -> None:
    pb = Playbook(ignore=())
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    pb.receive(1, client.request("GET", "/v1/stream"))
    pb.opened(-1)
    backend.events(pb.take(-1))
    pb.receive(-1, backend.sse_head())
    pb.now = 50.0
    pb >> sent(1, 10)  # progress at 50
    pb.now = 60.0
    pb >> wakeup("send", 1)
    pb << SetTimer(timer=("send", 1), at=110.0)  # moved, not fired
    pb.now = 110.0
    pb >> wakeup("send", 1)
    pb << Log(event="send_timeout", fields={"conn": 1})
    pb << CloseConnection(conn=1)
    pb << CloseConnection(conn=-1)  # the backend stops generating for nobody
    pb << CancelTimer(timer=("read", 1))
    outcome = "client aborted: client connection closed"
    pb << Log(event="access", fields=subset({"status": 200, "outcome": outcome}))
    pb.done()


def test_a_broken_h2_preface_is_answered_with_goaway_not_a_400() -> None:
    pb = Playbook()
    client = H2ClientPeer()
    client.preface()
    pb.accept(1)
    pb >> data(1, b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")  # no HTTP/1.1 request starts so
    pb << SetTimer(timer=("send", 1), at=60.0)
    answer = Sends(1, client)
    pb << answer
    pb << CloseConnection(conn=1)
    pb.done()
    (goaway,) = [e for e in answer.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
