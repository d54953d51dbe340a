"""The state tables of ``core/states.py`` and their machines: ``h2.H2Server``,
``pool.UpstreamConn`` and ``h2pool.H2Upstream``.

In the manner of h2's ``test_state_machines.py``: Hypothesis draws every (state, input) pair
of a table. The machine is brought to the state by a real ``ProxyCore`` (a Playbook
conversation) and given the input by the entry point that delivers it in the code (a method
call, or the peer's bytes). It must take exactly the table's transition: the new state, no
change where the table ignores the input, or ``IllegalTransition`` where it refuses it; and
every further transition the input causes (a release that closes what cannot be kept) must be
the table's too. A few pairs cannot be delivered by any entry point (a backend's first
SETTINGS after the first): they are fed to ``move`` itself, and listed with the reason.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

import hyperframe.frame
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from machines import take
from playbook import (
    BACKEND,
    H1BackendPeer,
    H1ClientPeer,
    H2BackendPeer,
    H2Client,
    Playbook,
    default_config,
)

from muxproxy.config import Config, Server, Upstream
from muxproxy.core.events import ShutdownRequested
from muxproxy.core.http2 import h2
from muxproxy.core.http2.h2 import SHUTDOWN_PING, H2Input, H2Server, H2State
from muxproxy.core.states import (
    IGNORED,
    ILLEGAL,
    IllegalTransition,
    Transitions,
    Verdict,
    missing,
    step,
)
from muxproxy.core.upstream import h2pool, pool
from muxproxy.core.upstream.h2pool import H2Upstream
from muxproxy.core.upstream.pool import UpstreamConn, UpstreamInput, UpstreamState

S = TypeVar("S", bound=enum.Enum)
In = TypeVar("In", bound=enum.Enum)

TABLES: list[tuple[str, Transitions[Any, Any], type[enum.Enum], type[enum.Enum]]] = [
    ("H2Server", h2.TRANSITIONS, H2State, H2Input),
    ("UpstreamConn", pool.TRANSITIONS, UpstreamState, UpstreamInput),
    ("H2Upstream", h2pool.TRANSITIONS, h2pool.H2State, h2pool.H2Input),
]


def pairs(states: type[S], inputs: type[In]) -> st.SearchStrategy[tuple[S, In]]:
    return st.sampled_from([(s, i) for s in states for i in inputs])


# Every pair, and a small space: Hypothesis stops once it has drawn each pair.
EVERY_PAIR = settings(max_examples=500, deadline=None)


# -- the tables ----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "table", "states", "inputs"), TABLES, ids=[t[0] for t in TABLES])
def test_table_lists_every_pair_once(
    name: str, table: Transitions[Any, Any], states: type[enum.Enum], inputs: type[enum.Enum]
) -> None:
    assert missing(table, states, inputs) == []
    assert len(table) == len(states) * len(inputs)
    for (state, input), target in table.items():
        assert isinstance(state, states) and isinstance(input, inputs), name
        assert isinstance(target, (states, Verdict)), name
        # A move changes the state: an input acted on that keeps it would read as ignored.
        assert target is not state, f"{name}: ({state.name}, {input.name}) keeps its state"


@pytest.mark.parametrize(("name", "table", "states", "inputs"), TABLES, ids=[t[0] for t in TABLES])
def test_closed_is_final(
    name: str, table: Transitions[Any, Any], states: type[enum.Enum], inputs: type[enum.Enum]
) -> None:
    closed = states["CLOSED"]
    assert {table[(closed, i)] for i in inputs} <= {IGNORED, ILLEGAL}, name


def test_step_moves_ignores_and_refuses() -> None:
    assert step(pool.TRANSITIONS, "c", UpstreamState.IDLE, UpstreamInput.REUSED) is (
        UpstreamState.BUSY
    )
    assert step(pool.TRANSITIONS, "c", UpstreamState.BUSY, UpstreamInput.OPENED) is None
    with pytest.raises(IllegalTransition) as refused:
        step(pool.TRANSITIONS, "c", UpstreamState.IDLE, UpstreamInput.RELEASED)
    assert refused.value.state is UpstreamState.IDLE
    assert refused.value.input is UpstreamInput.RELEASED
    assert str(refused.value) == "c: RELEASED is illegal in state IDLE"


# -- driving the machines ------------------------------------------------------------------


# -- h2.H2Server ---------------------------------------------------------------------------

SHUTDOWN_ACK = hyperframe.frame.PingFrame(0, opaque_data=SHUTDOWN_PING, flags=["ACK"])
CLIENT_GOAWAY = hyperframe.frame.GoAwayFrame(0, last_stream_id=1, error_code=0)


def undecodable(sid: int) -> bytes:
    """A request whose HPACK block cannot be decoded (RFC 7541 §2.3.3: index 70 of an empty
    dynamic table): a COMPRESSION_ERROR, a connection error."""
    flags = ["END_HEADERS", "END_STREAM"]
    return hyperframe.frame.HeadersFrame(sid, data=b"\xc6", flags=flags).serialize()


def client_h2(state: H2State) -> H2Server:
    """A client connection's ``H2Server`` in ``state``; its stream 1 waits for a backend, so
    the connection stays open while it drains."""
    pb = Playbook()
    client = H2Client(pb, 1)
    client.request()
    server = pb.core.clients[1].h2
    assert server is not None
    if state is H2State.GOING_AWAY:
        pb.feed(ShutdownRequested(now=pb.now, deadline=60.0))
    elif state is H2State.DRAINING:
        pb.receive(1, CLIENT_GOAWAY.serialize())
    elif state is H2State.CLOSED:
        pb.receive(1, undecodable(3))
    server.data_to_send()
    return server


def abuse(server: H2Server) -> None:
    """A budget ran out (``H2Guard``): the server answers at the end of the read."""
    server.guard.abuse("flood")
    server.receive(b"")


H2_SERVER_INPUTS: dict[H2Input, Callable[[H2Server], object]] = {
    H2Input.ANNOUNCE: lambda s: s.announce_shutdown(),
    H2Input.SHUTDOWN_ACK: lambda s: s.receive(SHUTDOWN_ACK.serialize()),
    H2Input.DRAIN: lambda s: s.drain(),
    H2Input.GOAWAY_RECEIVED: lambda s: s.receive(CLIENT_GOAWAY.serialize()),
    H2Input.ABUSE: abuse,
    H2Input.CONNECTION_ERROR: lambda s: s.receive(undecodable(5)),
}

H2_SERVER_UNREACHABLE = {
    # Once closed, h2 refuses every frame but a GOAWAY: a PING ACK is a CONNECTION_ERROR.
    (H2State.CLOSED, H2Input.SHUTDOWN_ACK),
}


@EVERY_PAIR
@given(pair=pairs(H2State, H2Input))
def test_h2_server_takes_every_pair_as_its_table_says(pair: tuple[H2State, H2Input]) -> None:
    state, input = pair
    server = client_h2(state)
    take(
        h2.TRANSITIONS,
        server,
        state,
        input,
        lambda: H2_SERVER_INPUTS[input](server),
        unreachable=pair in H2_SERVER_UNREACHABLE,
    )
    # An ignored input sends nothing, but for the GOAWAY that h2 itself queues on every error
    # it raises (it keeps the frame it refused, and refuses it again on the next read).
    if h2.TRANSITIONS[pair] is IGNORED and input is not H2Input.CONNECTION_ERROR:
        assert server.data_to_send() == b""


# -- pool.UpstreamConn ---------------------------------------------------------------------


def backend_h1(state: UpstreamState) -> tuple[Playbook, UpstreamConn]:
    """A backend connection in ``state``: a GET's connect; opened and the request sent; its
    response complete and the connection back in the idle pool; or closed by the backend
    while busy."""
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request())
    (opening,) = pb.opens()
    up = pb.core.upstreams[opening.conn]
    assert isinstance(up, UpstreamConn)
    if state is not UpstreamState.CONNECTING:
        pb.opened(up.conn)
        backend = H1BackendPeer()
        backend.events(pb.take(up.conn))
        if state is UpstreamState.IDLE:
            pb.receive(up.conn, backend.reply(b"{}"))
        elif state is UpstreamState.CLOSED:
            pb.closed(up.conn)
    return pb, up


def reuse(pb: Playbook, up: UpstreamConn) -> None:
    """A new request takes ``up`` from the idle pool (put there if it is not)."""
    idle = pb.core.pool.idle.setdefault(up.origin, [])
    if up not in idle:
        idle.append(up)
    pb.accept(2)
    pb.receive(2, H1ClientPeer().request())


def h1_inputs(pb: Playbook, up: UpstreamConn) -> dict[UpstreamInput, Callable[[], object]]:
    return {
        UpstreamInput.OPENED: up.on_opened,
        UpstreamInput.OPEN_FAILED: lambda: up.on_open_failed("refused"),
        UpstreamInput.REUSED: lambda: reuse(pb, up),
        UpstreamInput.RELEASED: up.release,
        UpstreamInput.IDLE_TIMEOUT: up.on_timer,
        UpstreamInput.TUNNEL: up.become_tunnel,
        UpstreamInput.CLOSE: up.close,
        UpstreamInput.PEER_CLOSED: lambda: up.on_closed(None),
    }


@EVERY_PAIR
@given(pair=pairs(UpstreamState, UpstreamInput))
def test_upstream_conn_takes_every_pair_as_its_table_says(
    pair: tuple[UpstreamState, UpstreamInput],
) -> None:
    state, input = pair
    pb, up = backend_h1(state)
    out = len(pb.core.fx.out)
    take(pool.TRANSITIONS, up, state, input, h1_inputs(pb, up)[input])
    if pool.TRANSITIONS[pair] is IGNORED and input is not UpstreamInput.REUSED:
        assert len(pb.core.fx.out) == out  # an ignored input does nothing


def test_release_of_a_connection_that_cannot_be_kept_closes_it_after_idle() -> None:
    """``RELEASED`` is BUSY to IDLE; a connection that cannot carry another (its response is
    not complete) is then closed from IDLE, each a transition of the table."""
    pb, up = backend_h1(UpstreamState.BUSY)
    moves = take(pool.TRANSITIONS, up, UpstreamState.BUSY, UpstreamInput.RELEASED, up.release)
    assert moves == [
        (UpstreamState.BUSY, UpstreamInput.RELEASED, UpstreamState.IDLE),
        (UpstreamState.IDLE, UpstreamInput.CLOSE, UpstreamState.CLOSED),
    ]
    assert up not in pb.core.upstreams.values()


# -- h2pool.H2Upstream ---------------------------------------------------------------------

UpState = h2pool.H2State  # the backend connection's, not the client's (h2.H2State)
UpInput = h2pool.H2Input
MAX_STREAM_ID = 2**31 - 1


def h2_config() -> Config:
    server = Server(address=BACKEND, protocol="h2", max_connections=1)
    return default_config(upstreams={"default": Upstream(name="default", servers=(server,))})


def backend_h2(state: h2pool.H2State) -> tuple[Playbook, H2Upstream]:
    """A shared HTTP/2 backend connection in ``state``: connecting; opened, its SETTINGS due;
    ready with one stream; draining, the stream ids used up by a second request; closed by
    the backend while ready."""
    pb = Playbook(h2_config())
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request())
    up = pb.core.upstreams[-1]
    assert isinstance(up, H2Upstream)
    if state is not UpState.CONNECTING:
        pb.opened(-1)
    if state in (UpState.READY, UpState.DRAINING, UpState.CLOSED):
        backend = H2BackendPeer(pb, -1)
        backend.read()
        pb.receive(-1, backend.output())
    if state is UpState.DRAINING:
        # RFC 9113 §5.1.1: the next stream takes the last id there is.
        up.client.conn.highest_outbound_stream_id = MAX_STREAM_ID - 2
        pb.accept(2)
        pb.receive(2, H1ClientPeer().request())
    elif state is UpState.CLOSED:
        pb.closed(-1)
    assert up.state is state
    return pb, up


def first_settings(up: H2Upstream) -> None:
    up.on_data(hyperframe.frame.SettingsFrame(0).serialize())


def backend_goaway(up: H2Upstream) -> None:
    up.on_data(hyperframe.frame.GoAwayFrame(0, last_stream_id=1, error_code=0).serialize())


def h2_inputs(up: H2Upstream) -> dict[h2pool.H2Input, Callable[[], object]]:
    return {
        UpInput.OPENED: up.on_opened,
        UpInput.OPEN_FAILED: lambda: up.on_open_failed("refused"),
        UpInput.SETTINGS: lambda: first_settings(up),
        UpInput.GOAWAY: lambda: backend_goaway(up),
        UpInput.RETIRE: up.retire,
        UpInput.CLOSE: up.close,
        UpInput.PEER_CLOSED: lambda: up.on_closed(None),
    }


H2_UPSTREAM_UNREACHABLE = {
    # The first SETTINGS made the connection READY: no later read brings a first one.
    (UpState.READY, UpInput.SETTINGS),
    (UpState.DRAINING, UpInput.SETTINGS),
    (UpState.CLOSED, UpInput.SETTINGS),
}


@EVERY_PAIR
@given(pair=pairs(h2pool.H2State, h2pool.H2Input))
def test_h2_upstream_takes_every_pair_as_its_table_says(
    pair: tuple[h2pool.H2State, h2pool.H2Input],
) -> None:
    state, input = pair
    pb, up = backend_h2(state)
    out = len(pb.core.fx.out)
    take(
        h2pool.TRANSITIONS,
        up,
        state,
        input,
        h2_inputs(up)[input],
        unreachable=pair in H2_UPSTREAM_UNREACHABLE,
    )
    quiet = input not in (UpInput.SETTINGS, UpInput.GOAWAY)  # bytes may be answered
    if h2pool.TRANSITIONS[pair] is IGNORED and quiet:
        assert len(pb.core.fx.out) == out  # an ignored input does nothing


def test_goaway_before_the_first_settings_drains_and_closes_the_connection() -> None:
    """RFC 9113 §6.8 in STARTING: DRAINING, and with no stream to finish, CLOSED at once."""
    _, up = backend_h2(UpState.STARTING)
    moves = take(
        h2pool.TRANSITIONS, up, UpState.STARTING, UpInput.GOAWAY, lambda: backend_goaway(up)
    )
    assert moves[:2] == [
        (UpState.STARTING, UpInput.GOAWAY, UpState.DRAINING),
        (UpState.DRAINING, UpInput.CLOSE, UpState.CLOSED),
    ]


def test_the_request_path_tables_hash_their_members_by_identity() -> None:
    # A table lookup hashes a (state, input) pair: ``Enum.__hash__`` would run Python code
    # (it hashes the member's name) twice for each of the dozen lookups of every request.
    from muxproxy.core.client import downstream_states
    from muxproxy.core.exchange.exchange_states import ExchangeInput
    from muxproxy.core.http2 import h2 as h2server
    from muxproxy.core.ports import Phase
    from muxproxy.core.upstream import h2pool, h2upstream_states, pool

    enums: list[type[enum.Enum]] = [
        Phase,
        ExchangeInput,
        downstream_states.ClientState,
        downstream_states.ClientInput,
        pool.UpstreamState,
        pool.UpstreamInput,
        pool.Progress,
        pool.ProgressInput,
        h2server.H2State,
        h2server.H2Input,
        h2upstream_states.H2State,
        h2upstream_states.H2Input,
        h2pool.StreamState,
        h2pool.StreamInput,
    ]
    slow = [cls.__qualname__ for cls in enums if cls.__hash__ is not object.__hash__]
    assert slow == []
    for cls in enums:
        pairs = {(member, member): member for member in cls}
        assert all(pairs[(member, member)] is member for member in cls)
