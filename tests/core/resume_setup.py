"""Set-up for tests of resumable streams (``route.resume``) that drive the core by hand: a
chat stream through the proxy (``Stream``) and a reconnect with ``Last-Event-ID`` over
HTTP/1.1 (``resume``) or HTTP/2 (``h2_resume``), each feeding events and returning the
commands they caused for the test to look into. ``test_resume.py`` holds the conversations.
"""

from __future__ import annotations

import re

import attrs
import h2.events
import h11
from playbook import H1BackendPeer, H1ClientPeer, H2ClientPeer, Playbook, default_config

from muxproxy.config import Config, Resume, Route
from muxproxy.core.commands import CloseConnection, Command, SetTimer

SSE = [("Accept", "text/event-stream")]
ID = re.compile(rb"id: ([A-Za-z0-9_-]{22})\.([0-9]+)")


def resume_config(**resume: object) -> Config:
    config = default_config()
    route = Route(prefix="/", upstream="default", resume=Resume(**resume))  # type: ignore[arg-type]
    return attrs.evolve(config, routes=(route,))


def body_of(client: H1ClientPeer, pb: Playbook, conn: int, commands: list[Command]) -> bytes:
    """The response body bytes ``client`` decodes from ``commands`` (reported written)."""
    data = pb.take(conn, commands)
    if not data:
        return b""  # (h11 takes b"" for the end of the input)
    pb.sent(conn, len(data))
    return b"".join(e.data for e in client.events(data) if isinstance(e, h11.Data))


def closes(commands: list[Command], conn: int) -> bool:
    return any(isinstance(c, CloseConnection) and c.conn == conn for c in commands)


def linger_timer(commands: list[Command]) -> SetTimer:
    (timer,) = [c for c in commands if isinstance(c, SetTimer) and c.timer[0] == "linger"]
    return timer


class Stream:
    """One client's chat stream through the proxy, to an HTTP/1.1 backend peer."""

    def __init__(
        self,
        pb: Playbook,
        conn: int = 1,
        headers: list[tuple[str, str]] = (),  # type: ignore[assignment]
        body: bytes = b"{}",
    ) -> None:
        self.pb, self.conn = pb, conn
        self.client = H1ClientPeer()
        pb.accept(conn)
        before = len(pb.opens())
        pb.receive(conn, self.client.request("POST", "/v1/chat/completions", [*headers], body))
        self.up = pb.opens()[before].conn
        pb.opened(self.up)
        pb.sent(self.up, len(pb.take(self.up)))
        self.backend = H1BackendPeer()
        self.backend.events(pb.take(self.up))
        head = pb.receive(self.up, self.backend.sse_head())
        self.received = body_of(self.client, pb, conn, head)

    def send(self, data: bytes) -> list[Command]:
        commands = self.pb.receive(self.up, self.backend.chunk(data))
        self.received += body_of(self.client, self.pb, self.conn, commands)
        return commands

    def last_id(self) -> bytes:
        token, seq = ID.findall(self.received)[-1]
        return token + b"." + seq


def resume(
    pb: Playbook, conn: int, event_id: bytes, headers: list[tuple[str, str]] = SSE
) -> tuple[H1ClientPeer, list[Command]]:
    client = H1ClientPeer()
    pb.accept(conn)
    commands = pb.receive(
        conn,
        client.request(
            "GET", "/v1/chat/completions", [*headers, ("Last-Event-ID", event_id.decode())]
        ),
    )
    return client, commands


def h2_resume(
    pb: Playbook,
    conn: int,
    event_id: bytes,
    *,
    method: bytes = b"GET",
    path: bytes = b"/v1/chat/completions",
) -> tuple[H2ClientPeer, list[h2.events.Event]]:
    """A new HTTP/2 client on ``conn`` asking for the events after ``event_id``: the client,
    and the events it decoded of what came back at once."""
    client = H2ClientPeer()
    pb.accept(conn)
    pb.receive(conn, client.preface())
    headers = [(b"accept", b"text/event-stream"), (b"last-event-id", event_id)]
    _sid, request = client.request(method, path, headers=headers)
    return client, client.events(pb.take(conn, pb.receive(conn, request)))
