"""SSE keep-alive comments (``route.sse_heartbeat``), driven with bytes only.

Real h11/h2 peers on both sides; each test is a conversation: every command asserted in
order, timers included. The client's socket takes what is sent only when a test feeds
``DataSent``, as the driver would."""

from __future__ import annotations

import attrs
import h2.events
import h11
from checks import h1_body, h1_request, h1_response, h2_response
from playbook import (
    ANY,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    data,
    default_config,
    opened,
    sent,
    wakeup,
)

from muxproxy.config import Config, Route
from muxproxy.core.commands import CancelTimer, OpenConnection, SetTimer
from muxproxy.core.streams.sse import HEARTBEAT

HEARTBEAT_TIMER = ("heartbeat", 1)


def heartbeat_config(**route: object) -> Config:
    config = default_config()
    return attrs.evolve(config, routes=(Route(prefix="/", upstream="default", **route),))


def start_h1(pb: Playbook, client: H1ClientPeer) -> H1BackendPeer:
    """Client 1 posts ``{}``; backend connection -1 takes it whole (reported written)."""
    pb.accept(1)
    pb >> data(1, client.request("POST", "/v1/chat/completions", body=b"{}"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb << SetTimer(timer=("body", 1), at=30.0)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, backend, h1_request(b"POST", b"/v1/chat/completions", b"{}")))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> sent(-1, len(request.data))
    return backend


def head_goes_out(pb: Playbook, client: H1ClientPeer, head: bytes) -> Sends:
    """The backend's response head ``head`` goes out to client 1 at once."""
    pb >> data(-1, head)
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=pb.now + 60.0)
    pb << (reply := Sends(1, client, h1_response(200)))
    pb << SetTimer(timer=("read", 1), at=pb.now + 300.0)
    return reply


def relays(pb: Playbook, client: H1ClientPeer, expected: bytes) -> Sends:
    """The next run to client 1 is exactly ``expected`` of body."""
    pb << (reply := Sends(1, client, lambda got: h1_body(got) == expected))
    return reply


def written(pb: Playbook, reply: Sends) -> None:
    """The client's socket takes all of ``reply``: nothing follows."""
    pb >> sent(1, len(reply.data))


def test_idle_sse_stream_gets_heartbeats_between_events_only() -> None:
    pb = Playbook(heartbeat_config(sse_heartbeat=5))
    client = H1ClientPeer()
    backend = start_h1(pb, client)
    head = head_goes_out(pb, client, backend.sse_head())
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=5.0)
    written(pb, head)

    # A thinking model: nothing for 5 s, so a comment goes out and the timer re-arms.
    pb.now = 5.0
    pb >> wakeup(*HEARTBEAT_TIMER)
    beat = relays(pb, client, HEARTBEAT)
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=10.0)
    written(pb, beat)

    # Half an event arrives (the CR of its CRLF included); relaying it costs no timer command.
    pb.now = 7.0
    pb >> data(-1, backend.chunk(b'data: {"token": 0}\r'))
    written(pb, relays(pb, client, b'data: {"token": 0}\r'))
    pb.now = 10.0
    pb >> wakeup(*HEARTBEAT_TIMER)  # nothing goes out
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=12.0)  # 5 s after the last upstream byte
    # Idle for the whole interval, but inside an event: the heartbeat waits.
    pb.now = 12.0
    pb >> wakeup(*HEARTBEAT_TIMER)
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=17.0)

    # The LF completes the CRLF: still inside the event. The empty line ends it.
    pb.now = 13.0
    pb >> data(-1, backend.chunk(b"\n"))
    written(pb, relays(pb, client, b"\n"))
    pb.now = 14.0
    pb >> data(-1, backend.chunk(b"\r\n"))
    written(pb, relays(pb, client, b"\r\n"))
    pb.now = 17.0
    pb >> wakeup(*HEARTBEAT_TIMER)
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=19.0)
    pb.now = 19.0
    pb >> wakeup(*HEARTBEAT_TIMER)
    beat = relays(pb, client, HEARTBEAT)
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=24.0)
    written(pb, beat)

    pb >> data(-1, backend.end())
    pb << Sends(1, client, lambda got: [type(e) for e in got] == [h11.EndOfMessage])
    pb << SetTimer(timer=("pool", -1), at=79.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=HEARTBEAT_TIMER)
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=94.0)
    pb.done()


def test_heartbeat_waits_while_the_client_has_unsent_bytes() -> None:
    pb = Playbook(heartbeat_config(sse_heartbeat=5))
    client = H1ClientPeer()
    backend = start_h1(pb, client)
    head_goes_out(pb, client, backend.sse_head())  # not reported written: the client is slow
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=5.0)
    pb.now = 5.0
    pb >> wakeup(*HEARTBEAT_TIMER)
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=10.0)  # nothing goes out
    pb.done()


def test_h2_client_gets_the_heartbeat_as_a_data_frame_on_its_stream() -> None:
    pb = Playbook(heartbeat_config(sse_heartbeat=2.5))
    pb.accept(1)
    client = H2ClientPeer()
    sid, request = client.request(b"POST", b"/v1/chat/completions", body=b"{}")
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client)  # the proxy's SETTINGS
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb << Sends(1, client)  # the SETTINGS ack
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, h1_request(b"POST", b"/v1/chat/completions", b"{}"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> data(-1, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200, ended=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=2.5)
    pb >> sent(1, len(pb.take(1)))  # everything so far, the SETTINGS frames too
    pb.now = 2.5
    pb >> wakeup(*HEARTBEAT_TIMER)
    pb << (beat := Sends(1, client))
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=5.0)
    pb.done()
    frames = [(e.stream_id, e.data) for e in beat.events if isinstance(e, h2.events.DataReceived)]
    assert frames == [(sid, HEARTBEAT)]
    assert len(beat.events) == 1, beat.events


def test_no_heartbeat_without_the_setting_or_for_other_content() -> None:
    pb = Playbook(heartbeat_config())
    client = H1ClientPeer()
    backend = start_h1(pb, client)
    head_goes_out(pb, client, backend.sse_head())
    pb.done()  # no heartbeat timer

    pb = Playbook(heartbeat_config(sse_heartbeat=5))
    client = H1ClientPeer()
    backend = start_h1(pb, client)
    json_head = backend.conn.send(
        h11.Response(status_code=200, headers=[("Content-Type", "application/json")])
    )
    head_goes_out(pb, client, json_head or b"")
    pb.done()  # no heartbeat timer, and so no heartbeat


def test_held_head_gets_no_heartbeat_until_it_went_out() -> None:
    pb = Playbook(heartbeat_config(sse_heartbeat=5, retry_until_first_event=True))
    client = H1ClientPeer()
    backend = start_h1(pb, client)
    pb >> data(-1, backend.sse_head())  # held: nothing sent, no heartbeat timer
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb.now = 8.0
    pb >> data(-1, backend.chunk(b"data: 1\n\n"))
    pb << SetTimer(timer=("send", 1), at=68.0)
    pb << (head := Sends(1, client, h1_response(200)))
    pb << SetTimer(timer=("read", 1), at=308.0)
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=13.0)  # from the commit, when the head went out
    first = relays(pb, client, b"data: 1\n\n")
    pb >> sent(1, len(head.data) + len(first.data))
    pb.now = 13.0
    pb >> wakeup(*HEARTBEAT_TIMER)
    beat = relays(pb, client, HEARTBEAT)
    pb << SetTimer(timer=HEARTBEAT_TIMER, at=18.0)
    written(pb, beat)
    pb.done()
