"""SSE keep-alive comments (``route.sse_heartbeat``), driven with bytes only."""

from __future__ import annotations

import attrs
import h2.events
import h11
from playbook import H1BackendPeer, H1ClientPeer, H2ClientPeer, Playbook, default_config

from muxproxy.config import Config, Route
from muxproxy.core.commands import CancelTimer, Command, SendData, SetTimer
from muxproxy.core.streams.sse import HEARTBEAT


def heartbeat_config(**route: object) -> Config:
    config = default_config()
    return attrs.evolve(config, routes=(Route(prefix="/", upstream="default", **route),))


def timers(commands: list[Command], kind: str) -> list[SetTimer]:
    return [c for c in commands if isinstance(c, SetTimer) and c.timer[0] == kind]


def h1_body(client: H1ClientPeer, pb: Playbook, commands: list[Command]) -> bytes:
    """What the client decodes from ``commands``; reports it written, as the driver would."""
    data = pb.take(1, commands)
    if data:
        pb.sent(1, len(data))
    return b"".join(e.data for e in client.events(data) if isinstance(e, h11.Data))


def start_h1(pb: Playbook, client: H1ClientPeer) -> tuple[int, H1BackendPeer]:
    pb.accept(1)
    pb.receive(1, client.request("POST", "/v1/chat/completions", body=b"{}"))
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    pb.sent(up, len(pb.take(up)))
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    return up, backend


def test_idle_sse_stream_gets_heartbeats_between_events_only() -> None:
    pb = Playbook(heartbeat_config(sse_heartbeat=5))
    client = H1ClientPeer()
    up, backend = start_h1(pb, client)
    head = pb.receive(up, backend.sse_head())
    assert isinstance(client.events(pb.take(1, head))[0], h11.Response)
    pb.sent(1, len(pb.take(1, head)))
    (armed,) = timers(head, "heartbeat")
    assert armed.at == 5.0
    ident = armed.timer[1]

    # A thinking model: nothing for 5 s, so a comment goes out and the timer re-arms.
    pb.now = 5.0
    commands = pb.wakeup("heartbeat", ident)
    assert h1_body(client, pb, commands) == HEARTBEAT
    assert timers(commands, "heartbeat")[0].at == 10.0

    # Half an event arrives (the CR of its CRLF included); relaying it costs no timer command.
    pb.now = 7.0
    commands = pb.receive(up, backend.chunk(b'data: {"token": 0}\r'))
    assert not any(isinstance(c, (SetTimer, CancelTimer)) for c in commands)
    assert h1_body(client, pb, commands) == b'data: {"token": 0}\r'
    pb.now = 10.0
    commands = pb.wakeup("heartbeat", ident)
    assert not pb.take(1, commands)
    assert timers(commands, "heartbeat")[0].at == 12.0  # 5 s after the last upstream byte
    # Idle for the whole interval, but inside an event: the heartbeat waits.
    pb.now = 12.0
    commands = pb.wakeup("heartbeat", ident)
    assert not pb.take(1, commands)
    assert timers(commands, "heartbeat")[0].at == 17.0

    # The LF completes the CRLF: still inside the event. The empty line ends it.
    pb.now = 13.0
    assert h1_body(client, pb, pb.receive(up, backend.chunk(b"\n"))) == b"\n"
    pb.now = 14.0
    assert h1_body(client, pb, pb.receive(up, backend.chunk(b"\r\n"))) == b"\r\n"
    pb.now = 17.0
    commands = pb.wakeup("heartbeat", ident)
    assert not pb.take(1, commands)
    assert timers(commands, "heartbeat")[0].at == 19.0
    pb.now = 19.0
    assert h1_body(client, pb, pb.wakeup("heartbeat", ident)) == HEARTBEAT

    commands = pb.receive(up, backend.end())
    assert CancelTimer(timer=("heartbeat", ident)) in commands
    assert isinstance(client.events(pb.take(1, commands))[-1], h11.EndOfMessage)


def test_heartbeat_waits_while_the_client_has_unsent_bytes() -> None:
    pb = Playbook(heartbeat_config(sse_heartbeat=5))
    client = H1ClientPeer()
    up, backend = start_h1(pb, client)
    head = pb.receive(up, backend.sse_head())  # not reported written: the client is slow
    (armed,) = timers(head, "heartbeat")
    pb.now = 5.0
    commands = pb.wakeup("heartbeat", armed.timer[1])
    assert not pb.take(1, commands)
    assert timers(commands, "heartbeat")[0].at == 10.0


def test_h2_client_gets_the_heartbeat_as_a_data_frame_on_its_stream() -> None:
    pb = Playbook(heartbeat_config(sse_heartbeat=2.5))
    pb.accept(1)
    client = H2ClientPeer()
    sid, data = client.request(b"POST", b"/v1/chat/completions", body=b"{}")
    pb.receive(1, client.preface() + data)
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    head = pb.receive(up, backend.sse_head())
    client.events(pb.take(1))
    pb.sent(1, len(pb.take(1)))
    (armed,) = timers(head, "heartbeat")
    pb.now = 2.5
    commands = pb.wakeup("heartbeat", armed.timer[1])
    events = client.events(pb.take(1, commands))
    frames = [(e.stream_id, e.data) for e in events if isinstance(e, h2.events.DataReceived)]
    assert frames == [(sid, HEARTBEAT)]


def test_no_heartbeat_without_the_setting_or_for_other_content() -> None:
    pb = Playbook(heartbeat_config())
    client = H1ClientPeer()
    up, backend = start_h1(pb, client)
    assert not timers(pb.receive(up, backend.sse_head()), "heartbeat")

    pb = Playbook(heartbeat_config(sse_heartbeat=5))
    client = H1ClientPeer()
    up, backend = start_h1(pb, client)
    json_head = backend.conn.send(
        h11.Response(status_code=200, headers=[("Content-Type", "application/json")])
    )
    assert not timers(pb.receive(up, json_head or b""), "heartbeat")
    assert not any(isinstance(c, SendData) and HEARTBEAT in c.data for c in pb.log)


def test_held_head_gets_no_heartbeat_until_it_went_out() -> None:
    pb = Playbook(heartbeat_config(sse_heartbeat=5, retry_until_first_event=True))
    client = H1ClientPeer()
    up, backend = start_h1(pb, client)
    assert not timers(pb.receive(up, backend.sse_head()), "heartbeat")  # held: nothing sent
    pb.now = 8.0
    commands = pb.receive(up, backend.chunk(b"data: 1\n\n"))
    (armed,) = timers(commands, "heartbeat")
    assert armed.at == 13.0  # from the commit, when the head went out
    assert h1_body(client, pb, commands) == b"data: 1\n\n"
    pb.now = 13.0
    assert h1_body(client, pb, pb.wakeup("heartbeat", armed.timer[1])) == HEARTBEAT
