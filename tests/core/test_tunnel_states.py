"""The life of a WebSocket tunnel as data: ``core/tunnel/tunnel_states.py`` and the ``Tunnel``
that obeys it.

In the manner of h2's ``test_state_machines.py``: Hypothesis draws every (state, input) pair.
A real ``ProxyCore`` conversation (an HTTP/1.1 client upgraded through an HTTP/1.1 backend)
brings the tunnel into the state, by the bytes and ends a driver reports; the input is then
given by the method that delivers it in the code, and the tunnel must do what the table says:
its first move is the table's and so is every move after it; an ignored input sends nothing;
an illegal one raises ``IllegalTransition`` naming the pair. The bytes of a side that still
flows take no table lookup (``CLIENT_FLOWS``, ``BACKEND_FLOWS``): they must be relayed.
"""

from __future__ import annotations

from collections.abc import Callable

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from machines import spy, take
from playbook import H1BackendPeer, Playbook

from muxproxy.core.commands import SendData
from muxproxy.core.events import InputEnded
from muxproxy.core.states import IGNORED, ILLEGAL, IllegalTransition, Verdict, missing
from muxproxy.core.tunnel.tunnel import Tunnel
from muxproxy.core.tunnel.tunnel_states import (
    BACKEND_FLOWS,
    CLIENT_FLOWS,
    TRANSITIONS,
    TunnelInput,
    TunnelState,
)
from muxproxy.core.tunnel.websocket import accept_for

_S = TunnelState
_I = TunnelInput
KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
HANDSHAKE = [
    ("Upgrade", "websocket"),
    ("Connection", "Upgrade"),
    ("Sec-WebSocket-Key", KEY.decode()),
    ("Sec-WebSocket-Version", "13"),
]
EVERY_PAIR = settings(max_examples=300, deadline=None)


def test_table_lists_every_pair_once_and_closed_is_final() -> None:
    assert missing(TRANSITIONS, TunnelState, TunnelInput) == []
    assert len(TRANSITIONS) == len(TunnelState) * len(TunnelInput)
    for target in TRANSITIONS.values():
        assert isinstance(target, (TunnelState, Verdict))
    assert {TRANSITIONS[(_S.CLOSED, i)] for i in TunnelInput} == {IGNORED}


def test_a_side_flows_until_it_ends_and_the_tunnel_closes() -> None:
    assert {_S.OPEN, _S.BACKEND_ENDED} == CLIENT_FLOWS
    assert {_S.OPEN, _S.CLIENT_ENDED} == BACKEND_FLOWS
    # Both ends, in either order, close the tunnel.
    assert TRANSITIONS[(_S.CLIENT_ENDED, _I.BACKEND_END)] is _S.CLOSED
    assert TRANSITIONS[(_S.BACKEND_ENDED, _I.CLIENT_END)] is _S.CLOSED


def tunnel_in(state: TunnelState) -> tuple[Playbook, Tunnel, int]:
    """An HTTP/1.1 client (conn 1) tunnelled to an HTTP/1.1 backend, in ``state``: open; one
    side's FIN relayed; closed by the backend. Returns the backend connection's id too."""
    pb = Playbook()
    pb.accept(1)
    request = h11.Connection(h11.CLIENT).send(
        h11.Request(method="GET", target="/ws", headers=[("Host", "p"), *HANDSHAKE])
    )
    pb.receive(1, request or b"")
    (opening,) = pb.opens()
    up = opening.conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    headers = [("Upgrade", "websocket"), ("Connection", "Upgrade")]
    headers.append(("Sec-WebSocket-Accept", accept_for(KEY).decode()))
    pb.receive(up, backend.conn.send(h11.InformationalResponse(status_code=101, headers=headers)))
    tunnel = pb.core.tunnels[1]
    if state is _S.CLIENT_ENDED:
        pb.feed(InputEnded(now=pb.now, conn=1))
    elif state is _S.BACKEND_ENDED:
        pb.feed(InputEnded(now=pb.now, conn=up))
    elif state is _S.CLOSED:
        pb.closed(up)
    assert tunnel.state is state
    return pb, tunnel, up


def inputs(tunnel: Tunnel) -> dict[TunnelInput, Callable[[], object]]:
    def client_drained() -> None:
        tunnel.backend_flow.stop()  # the backend was stopped for the client
        tunnel.client_drained()

    def backend_drained() -> None:
        tunnel.client_flow.stop()  # the client was stopped for the backend
        tunnel.backend_drained()

    return {
        _I.CLIENT_BYTES: lambda: tunnel.from_client(b"up", 0),
        _I.BACKEND_BYTES: lambda: tunnel.from_backend(b"down"),
        _I.CLIENT_END: tunnel.client_end,
        _I.BACKEND_END: tunnel.backend_end,
        _I.CLIENT_DRAINED: client_drained,
        _I.BACKEND_DRAINED: backend_drained,
        _I.IDLE_TIMER: tunnel.timer_fired,
        _I.CLOSE: lambda: tunnel.client_gone("gone"),
    }


@EVERY_PAIR
@given(pair=st.sampled_from([(s, i) for s in TunnelState for i in TunnelInput]))
def test_tunnel_takes_every_pair_as_its_table_says(pair: tuple[TunnelState, TunnelInput]) -> None:
    state, input = pair
    pb, tunnel, up = tunnel_in(state)
    out = len(pb.core.fx.out)
    deliver = inputs(tunnel)[input]
    fast = (input is _I.CLIENT_BYTES and state in CLIENT_FLOWS) or (
        input is _I.BACKEND_BYTES and state in BACKEND_FLOWS
    )
    if not fast:
        take(TRANSITIONS, tunnel, state, input, deliver)
        if TRANSITIONS[pair] is IGNORED:
            assert len(pb.core.fx.out) == out  # an ignored input does nothing
        return
    moves = spy(tunnel)
    deliver()
    assert moves == [] and tunnel.state is state
    sink, payload = (up, b"up") if input is _I.CLIENT_BYTES else (1, b"down")
    assert SendData(conn=sink, data=payload) in pb.core.fx.out[out:]


def test_bytes_from_a_side_that_ended_are_a_bug() -> None:
    _, tunnel, _ = tunnel_in(_S.CLIENT_ENDED)
    assert TRANSITIONS[(_S.CLIENT_ENDED, _I.CLIENT_BYTES)] is ILLEGAL
    with pytest.raises(
        IllegalTransition, match="Tunnel: CLIENT_BYTES is illegal in state CLIENT_ENDED"
    ):
        tunnel.from_client(b"late", 0)
