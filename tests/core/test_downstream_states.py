"""The state table of ``core/client/downstream_states.py`` and the ``Downstream`` that takes it.

In the manner of h2's ``test_state_machines.py``: Hypothesis draws every (state, input) pair.
A real ``ProxyCore`` (a Playbook conversation) brings a client connection to the state; the
input is given at the entry point that takes it in the code (a driver event's method, a timer,
the graceful stop's function, a step of the keep-alive cycle). It must do what the table says:
refuse it with ``IllegalTransition`` and change nothing, ignore it (no move, no command, no
deferred work), or take the table's transition, every further move it causes being the
table's too. The inputs of every token (DATA, SENT) are taken without a lookup in the states
that act on them: there the test checks that they were acted on (h11 holds the byte for its
next parse, h2 answered the client's PING, the write counted as progress). Nothing of the core
is replaced or wrapped, so the compiled build runs these tests too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import h2.events
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from machines import spy
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2Client,
    Playbook,
    h2_sse_stream,
    wakeup,
)
from test_client_timeouts import CHUNK, zero_window_book
from test_downstream import served_once
from test_h2c import h2_upgrade_client

from muxproxy.core.client import detect
from muxproxy.core.client.downstream import ClientInput, ClientState, Downstream, Protocol
from muxproxy.core.client.downstream_states import TIMER_INPUTS, TRANSITIONS
from muxproxy.core.commands import CloseConnection, SendData, SetTimer
from muxproxy.core.events import ShutdownRequested
from muxproxy.core.messages import RequestHead
from muxproxy.core.ports import RequestPhase
from muxproxy.core.shutdown import cut_client, refuse_client, stop_client
from muxproxy.core.states import IGNORED, ILLEGAL, IllegalTransition, Verdict, missing
from muxproxy.core.timers import ClientTimer

S = ClientState
In = ClientInput

PER_TOKEN = {In.DATA, In.SENT}
"""Inputs taken without a lookup where they are acted on (``ClientState.protocol``)."""

H1_TOKEN = b"G"
"""The bytes of DATA on an HTTP/1.1 connection, and where no protocol is chosen yet: the start
of a request line, which h11 holds until the line is whole."""

PING = b"pertoken"
"""The opaque data of the PING that is DATA on an HTTP/2 connection (RFC 9113 §6.7): a frame
the adapter answers at once, whatever the streams."""

# Every pair, and a small space: Hypothesis stops once it has drawn each pair.
EVERY_PAIR = settings(max_examples=1000, deadline=None)


# -- the table -----------------------------------------------------------------------------


def test_table_lists_every_pair_once() -> None:
    assert missing(TRANSITIONS, ClientState, ClientInput) == []
    assert len(TRANSITIONS) == len(ClientState) * len(ClientInput)
    for (state, input), target in TRANSITIONS.items():
        assert isinstance(state, ClientState) and isinstance(input, ClientInput)
        assert isinstance(target, (ClientState, Verdict))


def test_closed_is_final_and_takes_only_the_ends_of_its_own_work() -> None:
    """Once the driver reported the close the core routes nothing to the connection: what
    still reaches it is its own work under way (ignored); anything else is a bug."""
    late = {In.CLOSE, In.FINISHED, In.FOLLOW_UP}
    for input in ClientInput:
        assert TRANSITIONS[(S.CLOSED, input)] is (IGNORED if input in late else ILLEGAL)


def test_per_token_inputs_skip_the_table_only_where_it_acts_on_them() -> None:
    """The fast path acts on them in every state that speaks HTTP; elsewhere the table
    decides (it acts on bytes only while sniffing)."""
    for state in ClientState:
        for input in PER_TOKEN:
            acts = TRANSITIONS[(state, input)] is state
            if state.protocol in (Protocol.HTTP1, Protocol.HTTP2):
                assert acts, (state, input)
            else:
                assert not acts or state is S.SNIFFING, (state, input)


def test_every_timer_kind_is_an_input() -> None:
    assert set(TIMER_INPUTS) == set(ClientTimer)
    assert len(set(TIMER_INPUTS.values())) == len(ClientTimer)


# -- connections in each state -------------------------------------------------------------


@attrs.define
class Connection:
    """A client connection of a conversation: its ``Downstream``, and the HTTP/2 client on it
    (None while it speaks no HTTP/2)."""

    pb: Playbook
    down: Downstream
    client: H2Client | None = None


def served_h2(pb: Playbook) -> H2Client:
    """An HTTP/2 stream on connection 1, answered whole: the connection is idle after it."""
    client = H2Client(pb, 1)
    client.request(b"/v1/models")
    pb.opened(-1)
    backend = H1BackendPeer()
    backend.events(pb.take(-1))
    pb.receive(-1, backend.reply(b"{}"))
    return client


def connection(state: ClientState) -> Connection:
    """A client connection brought to ``state`` by a conversation with the core: nothing
    sent yet; part of a request head; a GET waiting for its backend; a request served and
    the connection kept alive; the same over HTTP/2 (the preface only, a stream waiting, a
    stream served); closed by us (its request head late, GOAWAY sent); closed by the client."""
    pb = Playbook()
    client = None
    if state is S.H1_IDLE:
        served_once(pb, H1ClientPeer(), H1BackendPeer())
    elif state is S.H2_IDLE:
        client = served_h2(pb)
    elif state in (S.H2_HEAD, S.H2_BUSY, S.CLOSING):
        client = H2Client(pb, 1)  # its preface
        if state is S.H2_BUSY:
            client.request()
    else:
        pb.accept(1)
    down = pb.core.clients[1]
    if state is S.H1_HEAD:
        pb.receive(1, b"GET /v1/models HT")
    elif state is S.H1_BUSY:
        pb.receive(1, H1ClientPeer().request())
    if state is S.CLOSING:
        pb.now = 30.0
        pb.wakeup("header", 1)
    elif state is S.CLOSED:
        pb.closed(1)
    assert down.state is state
    return Connection(pb=pb, down=down, client=client)


# -- the entry point of each input ---------------------------------------------------------


@attrs.define(eq=False)
class Gone:
    """An exchange as ``exchange_finished`` sees it, for a connection that carries none."""

    stream: int = 99
    request: RequestPhase = RequestPhase.COMPLETE


def a_head(down: Downstream) -> RequestHead:
    stream = down.h1.stream + 1 if down.h1 is not None else 101
    return RequestHead(
        stream=stream,
        method=b"GET",
        target=b"/v1/models",
        authority=b"proxy.example",
        scheme=b"http",
        headers=[],
        end_stream=True,
    )


def h2c_offer_rest() -> bytes:
    """The rest of ``connection(H1_HEAD)``'s head, as an h2c upgrade offer."""
    _, settings = h2_upgrade_client()
    return (
        b"TP/1.1\r\nHost: proxy.example\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: %s\r\n\r\n" % settings.encode()
    )


def token(at: Connection) -> bytes:
    """The bytes of a DATA input: a PING from the client where it speaks HTTP/2 (not yet
    read: the adapter answers it), else ``H1_TOKEN``."""
    if at.client is None or at.down.state.protocol is not Protocol.HTTP2:
        return H1_TOKEN
    at.client.peer.conn.ping(PING)
    return at.client.peer.conn.data_to_send()


def entry(at: Connection, input: ClientInput) -> Callable[[], object]:
    """The call that gives the connection the input in the code: a driver event, a timer, the
    stop, or the step of its own that takes it (which looks the table up before anything
    else, so a pair no path brings is refused there)."""
    pb, down = at.pb, at.down
    exchange: Any = next(iter(down.exchanges.values()), Gone())
    match input:
        case In.H1:
            return lambda: down._choose(Protocol.HTTP1)
        case In.H2:
            return lambda: down._choose(Protocol.HTTP2)
        case In.H2C if down.state is S.H1_HEAD:
            return lambda: down.on_data(h2c_offer_rest())
        case In.H2C:
            # A switch no path brings: the table refuses it before the adapters are used,
            # but they are real ones (a compiled ``Downstream`` checks their types).
            h1, h2s = detect.h1_server(down.fx, down.scheme), detect.h2_server(down.fx, down.scheme)
            return lambda: down._switch_to_h2c(h1, h2s)
        case In.DATA:
            data = token(at)
            return lambda: down.on_data(data)
        case In.SENT:
            return lambda: down.on_sent(0)
        case In.HEAD_BEGAN:
            return down._await_head
        case In.STARTED:
            return lambda: down._start_exchange(a_head(down))
        case In.FINISHED:
            return lambda: down.exchange_finished(exchange)
        case In.FOLLOW_UP:
            return lambda: down._after_exchange(exchange)
        case In.UNUSED:
            return down._go_idle
        case In.GOAWAY_TIMER:
            return lambda: pb.core.stop.goaway_due(down)
        case In.SEND_TIMER | In.WINDOW_TIMER | In.IDLE_TIMER | In.HEADER_TIMER:
            (kind,) = [k for k, i in TIMER_INPUTS.items() if i is input]
            return lambda: down.timer_fired(kind)
        case In.STOP:
            return lambda: stop_client(down)
        case In.REFUSE:
            return lambda: refuse_client(down)
        case In.CUT:
            return lambda: cut_client(down)
        case In.CLOSE:
            return down.close
        case In.PEER_CLOSED:
            return lambda: down.on_closed(None)
    raise AssertionError(input)


# -- taking every pair ---------------------------------------------------------------------


def acted_per_token(at: Connection, input: ClientInput) -> Callable[[], bool]:
    """Whether a per-token input was acted on without a lookup: the write counted as progress
    (at a time no earlier event had); h11 holds the byte after what it held (its public
    ``trailing_data``); h2 answered the client's PING with its ACK (RFC 9113 §6.7)."""
    down = at.down
    fx = down.fx
    if input is In.SENT:
        return lambda: down.output.last_progress == fx.now
    h1 = down.h1
    if h1 is not None:
        held = bytes(h1.conn.trailing_data[0])
        return lambda: bytes(h1.conn.trailing_data[0]) == held + H1_TOKEN
    client = at.client
    assert client is not None
    client.read(ack=False)  # what the proxy sent it before
    start = len(fx.out)

    def acked() -> bool:
        sent = fx.out[start:]
        data = b"".join(c.data for c in sent if isinstance(c, SendData) and c.conn == 1)
        events = client.peer.conn.receive_data(data)
        return any(isinstance(e, h2.events.PingAckReceived) and e.ping_data == PING for e in events)

    return acked


@EVERY_PAIR
@given(pair=st.sampled_from([(s, i) for s in ClientState for i in ClientInput]))
def test_downstream_takes_every_pair_as_its_table_says(
    pair: tuple[ClientState, ClientInput],
) -> None:
    state, input = pair
    at = connection(state)
    pb, down = at.pb, at.down
    fx = pb.core.fx
    fx.now = pb.now + 1.0  # the input's own moment
    deliver = entry(at, input)
    per_token = input in PER_TOKEN and state.protocol in (Protocol.HTTP1, Protocol.HTTP2)
    acted = acted_per_token(at, input) if per_token else None
    moves = spy(down)
    out, deferred = len(fx.out), len(fx.deferred)
    target = TRANSITIONS[pair]
    if target is ILLEGAL:
        with pytest.raises(IllegalTransition) as refused:
            deliver()
        assert (refused.value.state, refused.value.input) == (state, input)
        assert down.state is state
        assert (len(fx.out), len(fx.deferred)) == (out, deferred)
        return
    deliver()
    if target is IGNORED:
        assert moves == [(state, input, state)]
        assert down.state is state
        assert (len(fx.out), len(fx.deferred)) == (out, deferred)
        return
    if acted is not None:
        assert acted(), f"{input.name} was not acted on in {state.name}"
        assert all(i is not input for _, i, _ in moves)  # no lookup
    else:
        assert moves[:1] == [(state, input, target)]
    at = state
    for before, later, after in moves:
        assert before is at, moves
        then = TRANSITIONS[(before, later)]
        assert then is not ILLEGAL, moves
        assert after is (before if then is IGNORED else then), moves
        at = after
    assert down.state is at


# -- late inputs once we closed: the driver is flushing, the close not reported yet --------
#
# Each of these was acted on before the table said otherwise: a timer that fired after our
# close ran its handler on a closed connection, and the graceful stop reached it as if open.

BAD_HEAD = b"GET / HTTP/1.1\r\nHost: proxy.example\r\nno colon here\r\n\r\n"


def test_a_header_timeout_after_our_close_counts_no_defence() -> None:
    pb = Playbook(ignore=())
    pb.accept(1)
    pb.receive(1, BAD_HEAD)  # 400 and the close; the client does not read it
    pb.now = 30.0
    pb >> wakeup("header", 1)
    pb.done()
    assert pb.core.counters["request_header_timeout"] == 0


def test_the_send_timer_after_our_close_leaves_the_flush_to_the_driver() -> None:
    """``CloseConnection.flush_timeout`` bounds the flush: no second verdict on it."""
    pb = Playbook(ignore=())
    pb.accept(1)
    pb.receive(1, BAD_HEAD)
    pb.now = 60.0
    pb >> wakeup("send", 1)
    pb.done()


def test_a_window_timeout_after_our_close_cuts_no_stream() -> None:
    pb, client = zero_window_book(send=60.0)
    pb.ignore = ()
    _, up = h2_sse_stream(pb, client, data=client.preface())
    pb.receive(up, CHUNK)  # queued behind the closed window: the window timer runs
    pb.now = 60.0
    pb >> wakeup("send", 1)  # nothing written since: the send timeout closes the connection
    assert CloseConnection(conn=1) in pb.rest()
    pb >> wakeup("window", 1)
    pb.done()
    assert pb.core.counters["stream_send_timeout"] == 0


def test_a_graceful_stop_arms_no_timer_for_a_connection_we_closed() -> None:
    pb = Playbook()
    pb.accept(1, tls=True, alpn="http/1.1")
    pb.now = 30.0
    pb >> wakeup("header", 1)  # no request came: closed
    pb << CloseConnection(conn=1)
    pb.done()
    commands = pb.feed(ShutdownRequested(now=pb.now, deadline=60.0))
    assert [c for c in commands if isinstance(c, SetTimer) and c.timer[1] == 1] == []
