"""Tunnel ends where one side is TLS, bytes only: a TLS connection cannot be half-closed
(``ShutdownWrite`` does nothing there), so the other side's end closes it, after what is
pending for it. Plain TCP keeps the half-close relay (``test_tunnel.py``).
"""

from __future__ import annotations

import h11
from playbook import BACKEND, H1BackendPeer, Playbook, data, default_config, subset

from muxproxy.config import Server, Upstream
from muxproxy.core.commands import CancelTimer, CloseConnection, Log, SendData, ShutdownWrite
from muxproxy.core.events import InputEnded
from muxproxy.core.tunnel.websocket import accept_for

KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
TUNNEL = ("tunnel", 1)


def _upgrade_request() -> bytes:
    client = h11.Connection(h11.CLIENT)
    headers = [
        ("Host", "p"),
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", KEY.decode()),
        ("Sec-WebSocket-Version", "13"),
    ]
    return client.send(h11.Request(method="GET", target="/ws", headers=headers)) or b""


def _open(pb: Playbook, *, client_tls: bool) -> int:
    """A tunnel switched on both sides; returns the backend connection's id."""
    pb.accept(1, tls=client_tls, alpn="http/1.1" if client_tls else None)
    pb.receive(1, _upgrade_request())
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    switch = h11.InformationalResponse(
        status_code=101,
        headers=[
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            ("Sec-WebSocket-Accept", accept_for(KEY).decode()),
        ],
    )
    pb.receive(up, backend.conn.send(switch) or b"")
    pb.rest()
    return up


def test_backend_end_closes_a_tls_client_after_its_close_frame_is_flushed() -> None:
    pb = Playbook(ignore=())
    up = _open(pb, client_tls=True)
    pb >> data(up, b"backend-close")
    pb << SendData(conn=1, data=b"backend-close")
    pb >> InputEnded(now=pb.now, conn=up)
    pb << CancelTimer(timer=TUNNEL)
    pb << CloseConnection(conn=up)
    pb << Log(event="tunnel_closed", fields=subset({"reason": "backend ended"}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CloseConnection(conn=1)  # flushes ``backend-close`` first
    pb.done()
    assert not any(isinstance(c, ShutdownWrite) for c in pb.log)


def test_client_end_closes_a_tls_backend() -> None:
    group = Upstream(name="default", servers=(Server(address=BACKEND, tls=True),))
    pb = Playbook(default_config(upstreams={"default": group}), ignore=())
    up = _open(pb, client_tls=False)
    pb >> data(1, b"client-close")
    pb << SendData(conn=up, data=b"client-close")
    pb >> InputEnded(now=pb.now, conn=1)
    pb << CancelTimer(timer=TUNNEL)
    pb << CloseConnection(conn=up)  # flushes ``client-close`` first
    pb << Log(event="tunnel_closed", fields=subset({"reason": "client ended"}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CloseConnection(conn=1)
    pb.done()
    assert not any(isinstance(c, ShutdownWrite) for c in pb.log)


def test_plain_tcp_client_still_gets_the_backend_end_as_a_half_close() -> None:
    pb = Playbook(ignore=())
    up = _open(pb, client_tls=False)
    pb >> InputEnded(now=pb.now, conn=up)
    pb << ShutdownWrite(conn=1)
    pb.done()
    assert pb.core.tunnels[1].state.value == "backend_ended"
