"""The reactor's own rules (``muxproxy/trio/reactor.py``), driven directly.

The reactor runs with a real ``ProxyCore`` (it asks it for ``read_size``) and a recording
``Sink`` that stands where the driver stands (``recording.Recorder``); every connection is a
real TCP pair on 127.0.0.1. A test waits for what the recorder saw, under ``fail_after``; the
rules bounded in time run under ``MockClock`` (pytest-trio's ``autojump_clock``), so a
deadline is met exactly, in no real time.

"Not read" is shown with a canary: a second connection whose peer writes after the held
one's peer did. The round that feeds the canary would have fed the held input too (``epoll``
reports every ready socket at once, level-triggered), so once the canary is fed, nothing
else was. "Does not wake the reactor" is shown by the rounds counted across
``wait_all_tasks_blocked``: a socket that woke it would keep it busy, round after round.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from recording import (
    Recorder,
    drain,
    make_core,
    pattern,
    peek,
    receive,
    receive_to_eof,
    recording,
    send_all,
)

from muxproxy.core.events import (
    ConnectionOpened,
    DataReceived,
    Event,
    InputEnded,
    OpenFailed,
)
from muxproxy.trio import reactor
from muxproxy.trio.reactor import LINGER, LINGER_BYTES

TIMEOUT = 10
MIB = 1 << 20


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    async with recording() as recorder:
        yield recorder


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def reset(peer: socket.socket) -> None:
    """Close ``peer`` with an RST (SO_LINGER 0)."""
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    peer.close()


# -- events: each from its own socket --------------------------------------------------------


async def test_each_read_is_fed_as_data_of_its_own_connection_with_the_rounds_time(
    recorder: Recorder,
) -> None:
    _, one = recorder.pair(1)
    _, two = recorder.pair(2)
    one.send(b"first")
    two.send(b"second")
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: len(recorder.fed) == 2)
    assert recorder.data(1) == b"first" and recorder.data(2) == b"second"
    # Both were ready at one wake-up: one round, one clock read for its events.
    assert len({f.round for f in recorder.fed}) == 1
    assert len({f.event.now for f in recorder.fed}) == 1


async def test_sends_reach_their_own_connection_in_the_order_given(recorder: Recorder) -> None:
    _, backend = recorder.pair(1)
    a, a_peer = recorder.pair(2)
    b, b_peer = recorder.pair(3)

    def react(event: Event) -> None:
        if isinstance(event, DataReceived) and event.conn == 1:
            for token in (b"a1", b"b1", b"a2", b"b2", b"a3"):
                recorder.send(a if token.startswith(b"a") else b, token)

    recorder.react = react
    backend.send(b"go")
    with trio.fail_after(TIMEOUT):
        assert await receive(a_peer, 6) == b"a1a2a3"
        assert await receive(b_peer, 4) == b"b1b2"
    assert peek(backend) == b""


async def test_bytes_sent_behind_a_full_socket_follow_in_order_at_epollout(
    recorder: Recorder,
) -> None:
    conn, peer = recorder.pair(1, small=True)
    payload = pattern(MIB)
    # Outside a round (a timer's send): it waits for write_queued, which the kernel takes
    # part of; the rest waits for EPOLLOUT, and what is sent next follows it.
    assert recorder.send(conn, payload) is True
    recorder.write_if_asked()
    assert sum(s.nbytes for s in recorder.sent) < len(payload)
    assert recorder.send(conn, b"tail") is False
    with trio.fail_after(TIMEOUT):
        assert await receive(peer, len(payload) + 4) == payload + b"tail"
        await recorder.until(lambda: sum(s.nbytes for s in recorder.sent) == len(payload) + 4)
    # Everything after the first send went out from the reactor's rounds (EPOLLOUT).
    assert all(s.round is not None for s in recorder.sent[1:])


# -- batching: one send per connection, and when ---------------------------------------------


async def test_what_one_read_causes_leaves_in_one_send_before_the_next_socket_is_read(
    recorder: Recorder,
) -> None:
    # Backend 1 feeds client 2, backend 3 feeds client 4 (the paced path: one read, tokens).
    feeds = {1: 2, 3: 4}
    peers = {}
    for ident in (1, 2, 3, 4):
        _, peers[ident] = recorder.pair(ident)
    other_client = {1: peers[4], 3: peers[2]}
    seen_by: dict[int, bytes] = {}

    def react(event: Event) -> None:
        if isinstance(event, DataReceived) and event.conn in feeds:
            # What the other backend's client already has when this backend is read.
            seen_by[event.conn] = peek(other_client[event.conn])
            for token in event.data.split(b","):
                recorder.send(recorder.conns[feeds[event.conn]], token)

    recorder.react = react
    # A client's first feeder: its output waits for the end of the round (and says so).
    peers[1].send(b"x")
    peers[3].send(b"y")
    with trio.fail_after(TIMEOUT):
        assert await receive(peers[2], 1) == b"x"
        assert await receive(peers[4], 1) == b"y"
    assert recorder.waits == [True, True]
    recorder.waits = []
    sent_before = len(recorder.sent)

    peers[1].send(b"t1,t2,t3")
    peers[3].send(b"u1,u2,u3")
    with trio.fail_after(TIMEOUT):
        assert await receive(peers[2], 6) == b"t1t2t3"
        assert await receive(peers[4], 6) == b"u1u2u3"
    round_fed = [f for f in recorder.fed if f.round == recorder.fed[-1].round]
    assert len(round_fed) == 2, "both backends were read in one round"
    first, second = (f.event.conn for f in round_fed if isinstance(f.event, DataReceived))
    # The first backend's tokens were on its client's wire before the second was read.
    assert seen_by[first] == b""
    assert seen_by[second] == (b"t1t2t3" if first == 1 else b"u1u2u3")
    # One send per client for the three tokens, and none asked for write_queued.
    sent = recorder.sent[sent_before:]
    assert [(s.conn, s.nbytes) for s in sent] == [(feeds[first], 6), (feeds[second], 6)]
    assert len({s.round for s in sent}) == 1
    assert recorder.waits == [False] * 6


async def two_backends_feed_one_client(recorder: Recorder) -> tuple[bytes, dict[int, bytes]]:
    """Backends 1 and 2 each send one chunk, which goes to client 3: what the client got, and
    what it had got when each backend was read."""
    _, one = recorder.pair(1)
    _, two = recorder.pair(2)
    client, client_peer = recorder.pair(3)
    seen_by: dict[int, bytes] = {}

    def react(event: Event) -> None:
        if isinstance(event, DataReceived) and event.conn in (1, 2):
            seen_by[event.conn] = peek(client_peer)
            recorder.send(client, event.data)

    recorder.react = react
    one.send(b"one")
    two.send(b"two")
    with trio.fail_after(TIMEOUT):
        got = await receive(client_peer, 6)
    return got, seen_by


async def test_a_connection_fed_by_several_sockets_in_a_round_is_written_once_at_its_end(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A round shorter than the shared write's wait (made long here: a loaded machine may take
    # longer than the default between two sockets).
    monkeypatch.setattr(reactor, "SHARED_WRITE_WAIT", 60.0)
    got, seen_by = await two_backends_feed_one_client(recorder)
    order = [e.data for f in recorder.fed if isinstance(e := f.event, DataReceived)]
    assert got == b"".join(order)
    assert seen_by == {1: b"", 2: b""}, "nothing was written before the end of the round"
    # The first send asks for write_queued; the second joins the bytes already waiting.
    assert recorder.waits == [True, False]
    (sent,) = recorder.sent_of(3)
    assert sent.nbytes == 6 and sent.round == recorder.fed[-1].round


async def test_a_shared_connection_is_written_within_a_long_round_once_its_wait_is_over(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No wait at all: after each ready socket, what waits for the end of the round goes.
    monkeypatch.setattr(reactor, "SHARED_WRITE_WAIT", 0.0)
    got, seen_by = await two_backends_feed_one_client(recorder)
    fed = [f for f in recorder.fed if isinstance(f.event, DataReceived)]
    assert len({f.round for f in fed}) == 1, "both were read in one round"
    first, second = (f.event.conn for f in fed)
    sent_by = {1: b"one", 2: b"two"}
    assert got == sent_by[first] + sent_by[second]
    # The first socket's bytes were on the wire before the second socket was read.
    assert seen_by == {first: b"", second: sent_by[first]}
    assert [s.nbytes for s in recorder.sent_of(3)] == [3, 3]


async def test_a_send_outside_a_round_waits_for_write_queued(recorder: Recorder) -> None:
    conn, peer = recorder.pair(1)
    assert recorder.reactor.send(conn, b"late") is True
    with trio.fail_after(TIMEOUT):
        await trio.testing.wait_all_tasks_blocked()
    assert peek(peer) == b"", "nothing goes out before write_queued"
    recorder.reactor.write_queued()
    assert peek(peer) == b"late"
    assert [(s.conn, s.nbytes, s.round) for s in recorder.sent] == [(1, 4, None)]


async def test_a_send_to_a_closed_connection_is_dropped(recorder: Recorder) -> None:
    conn, peer = recorder.pair(1)
    recorder.reactor.close(conn)
    assert recorder.reactor.send(conn, b"too late") is False
    recorder.reactor.write_queued()
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(peer) == b""
    assert recorder.sent == []


# -- CloseConnection -------------------------------------------------------------------------


async def test_close_flushes_what_is_pending_then_closes(recorder: Recorder) -> None:
    conn, peer = recorder.pair(1, small=True)
    payload = pattern(MIB)
    recorder.send(conn, payload)
    recorder.write_if_asked()
    recorder.reactor.close(conn)
    assert recorder.closed == [], "not before what is pending is written"
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(peer) == payload
        await recorder.until(lambda: bool(recorder.closed))
    (closed,) = recorder.closed
    assert closed.conn == 1 and closed.error is None
    sent = recorder.sent_of(1)
    assert sum(s.nbytes for s in sent) == len(payload)
    assert max(s.seq for s in sent) < closed.seq, "DataSent's bytes before ConnectionClosed"
    assert [r.conn for r in recorder.released] == [1]


async def test_close_with_nothing_pending_closes_at_once(recorder: Recorder) -> None:
    conn, peer = recorder.pair(1)
    recorder.reactor.close(conn)
    # Reported within the call (the driver feeds it after the batch).
    assert [(c.conn, c.error) for c in recorder.closed] == [(1, None)]
    assert [r.conn for r in recorder.released] == [1]
    assert recorder.forgotten == [1]
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(peer) == b""


async def test_a_flush_without_progress_is_cut_at_flush_timeout_from_its_last_progress(
    recorder: Recorder, autojump_clock: trio.testing.MockClock
) -> None:
    conn, peer = recorder.pair(1, small=True)
    payload = pattern(4 * MIB)
    recorder.send(conn, payload)
    recorder.write_if_asked()
    await trio.sleep(0.5)
    # The peer has read nothing since the bytes got stuck: the bound counts from then,
    # not from the close.
    stuck_since = max(s.at for s in recorder.sent_of(1))
    assert stuck_since < 0.5
    recorder.reactor.close(conn, flush_timeout=1.0)
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: bool(recorder.closed))
    (closed,) = recorder.closed
    assert closed.at == pytest.approx(stuck_since + 1.0)
    assert closed.error is None
    assert [r.conn for r in recorder.released] == [1]
    assert sum(s.nbytes for s in recorder.sent_of(1)) < len(payload)
    assert drain(peer) < len(payload)


async def test_progress_of_the_flush_moves_its_bound(
    recorder: Recorder, autojump_clock: trio.testing.MockClock
) -> None:
    conn, peer = recorder.pair(1, small=True)
    payload = pattern(4 * MIB)
    recorder.send(conn, payload)
    recorder.write_if_asked()
    recorder.reactor.close(conn, flush_timeout=1.0)
    await trio.sleep(0.6)
    assert recorder.closed == []
    # The peer reads what has arrived: the kernel takes more, and the bound starts again.
    assert drain(peer) > 0
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: any(s.at >= 0.6 for s in recorder.sent_of(1)))
        await recorder.until(lambda: bool(recorder.closed))
    last_progress = max(s.at for s in recorder.sent_of(1))
    assert last_progress == pytest.approx(0.6)
    (closed,) = recorder.closed
    assert closed.at == pytest.approx(last_progress + 1.0)


async def test_connection_closed_is_reported_once_whatever_comes_after(
    recorder: Recorder,
) -> None:
    # 1: closed twice, then abandoned. 2: abandoned while its flush waits, then closed again.
    # 3: its peer resets the connection while the flush waits. 4: a client connection that
    # lingers after its close; its peer ends the connection meanwhile.
    twice, _ = recorder.pair(1)
    abandoned, _ = recorder.pair(2, small=True)
    broken, broken_peer = recorder.pair(3, small=True)
    lingering, lingering_peer = recorder.pair(4, linger=True)
    reactor = recorder.reactor
    reactor.close(twice)
    reactor.close(twice)
    reactor.abandon(twice, "internal error")
    for conn in (abandoned, broken):
        recorder.send(conn, pattern(MIB))
    recorder.write_if_asked()
    reactor.close(abandoned)
    reactor.abandon(abandoned, "internal error")
    reactor.close(abandoned)
    reactor.close(broken)
    reset(broken_peer)
    reactor.close(lingering)
    reactor.abandon(lingering, "internal error")  # the core heard of it: nothing more
    lingering_peer.close()
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: len(recorder.released) == 4)
    for conn in (broken, lingering):
        reactor.close(conn)
        reactor.abandon(conn, "internal error")
    closed = {c.conn: c.error for c in recorder.closed}
    assert len(recorder.closed) == 4
    assert closed[1] is None and closed[2] == "internal error" and closed[4] is None
    assert closed[3] is not None and closed[3].startswith("send failed")


# -- a client connection's close in stages (lingering) ---------------------------------------


async def test_a_client_connection_is_shut_down_first_and_its_late_input_dropped(
    recorder: Recorder,
) -> None:
    conn, peer = recorder.pair(1, linger=True)
    _, canary = recorder.pair(2)
    reactor = recorder.reactor
    # Input the core never read is in the socket at the close: closing the socket now would
    # send an RST, and the client might lose the response (RFC 9112 §9.6).
    reactor.pause(conn)
    peer.send(b"pipelined, never read")
    recorder.send(conn, b"408 response")
    recorder.write_if_asked()
    reactor.close(conn)
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(peer) == b"408 response"  # then a FIN, not an RST
    assert [c.conn for c in recorder.closed] == [1], "the core hears of it at the FIN"
    assert recorder.forgotten == [1], "and commands no more"
    assert recorder.released == [], "the socket lingers"
    peer.send(b"more")
    canary.send(b"tweet")
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: recorder.data(2) == b"tweet")
    assert recorder.events(1, Event) == [], "what it reads while lingering is dropped"
    peer.shutdown(socket.SHUT_WR)
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: bool(recorder.released))
    assert [r.conn for r in recorder.released] == [1]
    assert len(recorder.closed) == 1


async def test_lingering_ends_after_linger_seconds(
    recorder: Recorder, autojump_clock: trio.testing.MockClock
) -> None:
    conn, peer = recorder.pair(1, linger=True)
    recorder.reactor.close(conn)
    (closed,) = recorder.closed
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: bool(recorder.released))
    (released,) = recorder.released
    assert released.at - closed.at == pytest.approx(LINGER)
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(peer) == b""


async def test_lingering_ends_sooner_for_a_peer_that_keeps_sending(
    recorder: Recorder, autojump_clock: trio.testing.MockClock
) -> None:
    conn, peer = recorder.pair(1, linger=True)
    recorder.reactor.close(conn)
    (closed,) = recorder.closed
    with trio.fail_after(TIMEOUT):
        await send_all(peer, b"x" * LINGER_BYTES)
        await recorder.until(lambda: bool(recorder.released))
    (released,) = recorder.released
    assert released.at - closed.at < LINGER
    assert recorder.events(1, Event) == []


async def test_no_lingering_once_the_peer_has_ended_its_side(recorder: Recorder) -> None:
    conn, peer = recorder.pair(1, linger=True)
    peer.shutdown(socket.SHUT_WR)
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: bool(recorder.events(1, InputEnded)))
    recorder.reactor.close(conn)
    assert [r.conn for r in recorder.released] == [1], "nothing left to read: closed at once"
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(peer) == b""


# -- PauseReading, ResumeReading, the end of input, ShutdownWrite ----------------------------


async def test_a_paused_connection_is_not_read_until_resumed(recorder: Recorder) -> None:
    held, held_peer = recorder.pair(1)
    _, canary = recorder.pair(2)
    recorder.reactor.pause(held)
    held_peer.send(b"held")
    held_peer.shutdown(socket.SHUT_WR)
    rounds = recorder.rounds
    with trio.fail_after(TIMEOUT):
        await trio.testing.wait_all_tasks_blocked()
    assert recorder.rounds == rounds, "a paused socket's input and hang-up wake nobody"
    canary.send(b"tweet")
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: recorder.data(2) == b"tweet")
    assert recorder.events(1, Event) == []
    recorder.reactor.resume(held)
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: bool(recorder.events(1, InputEnded)))
    assert [type(e) for e in recorder.events(1, Event)] == [DataReceived, InputEnded]
    assert recorder.data(1) == b"held"


async def test_a_paused_connection_with_output_pending_is_written_not_read(
    recorder: Recorder,
) -> None:
    conn, peer = recorder.pair(1, small=True)
    _, canary = recorder.pair(2)
    payload = pattern(MIB)
    recorder.send(conn, payload)
    recorder.write_if_asked()
    recorder.reactor.pause(conn)
    peer.send(b"not now")
    with trio.fail_after(TIMEOUT):
        assert await receive(peer, len(payload)) == payload
    canary.send(b"tweet")
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: recorder.data(2) == b"tweet")
    assert recorder.events(1, Event) == []


async def test_the_end_of_input_is_fed_once_and_the_connection_still_written(
    recorder: Recorder,
) -> None:
    conn, peer = recorder.pair(1)
    _, canary = recorder.pair(2)
    peer.shutdown(socket.SHUT_WR)
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: bool(recorder.events(1, InputEnded)))
    rounds = recorder.rounds
    with trio.fail_after(TIMEOUT):
        await trio.testing.wait_all_tasks_blocked()
    assert recorder.rounds == rounds, "the end of file, level-triggered, is not served again"
    recorder.reactor.resume(conn)  # paused for good
    canary.send(b"tweet")
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: recorder.data(2) == b"tweet")
    assert [type(e) for e in recorder.events(1, Event)] == [InputEnded]
    recorder.send(conn, b"still written")
    recorder.write_if_asked()
    with trio.fail_after(TIMEOUT):
        assert await receive(peer, 13) == b"still written"


@pytest.mark.parametrize("pending", [0, MIB])
async def test_shutdown_write_ends_our_side_after_what_is_pending_and_reading_goes_on(
    recorder: Recorder, pending: int
) -> None:
    conn, peer = recorder.pair(1, small=True)
    payload = pattern(pending)
    if payload:
        recorder.send(conn, payload)
        recorder.write_if_asked()
    recorder.reactor.shutdown_write(conn)
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(peer) == payload
    peer.send(b"still read")
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: recorder.data(1) == b"still read")
    assert recorder.closed == []


# -- connects ----------------------------------------------------------------------------------


async def test_a_connect_is_fed_from_a_round_and_what_was_queued_meanwhile_goes_out(
    recorder: Recorder,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn = recorder.reactor.connect(7, "127.0.0.1", server.getsockname()[1])
        recorder.send(conn, b"request")
        recorder.write_if_asked()  # nothing to write to yet
        assert recorder.sent == []
        with trio.fail_after(TIMEOUT):
            await recorder.until(lambda: bool(recorder.events(7, ConnectionOpened)))
        accepted, _ = server.accept()
        with accepted:
            accepted.setblocking(False)
            with trio.fail_after(TIMEOUT):
                assert await receive(accepted, 7) == b"request"


async def test_a_refused_connect_is_fed_as_open_failed(recorder: Recorder) -> None:
    recorder.reactor.connect(7, "127.0.0.1", closed_port())
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: bool(recorder.events(7, OpenFailed)))
    (failed,) = recorder.events(7, OpenFailed)
    assert failed.reason == "connect failed: Connection refused"
    assert recorder.forgotten == [7]
    assert recorder.closed == [] and recorder.open_failed == []


async def test_a_close_while_connecting_gives_up_the_connect(recorder: Recorder) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn = recorder.reactor.connect(7, "127.0.0.1", server.getsockname()[1])
        recorder.reactor.close(conn)
        assert [(c.conn, c.error) for c in recorder.closed] == [(7, "cancelled")]
        with trio.fail_after(TIMEOUT):
            await trio.testing.wait_all_tasks_blocked()
        assert recorder.fed == []


# -- faults --------------------------------------------------------------------------------


async def test_a_driver_error_for_one_socket_abandons_it_and_the_round_goes_on(
    recorder: Recorder,
) -> None:
    recorder.raise_errors = False
    _, bad = recorder.pair(1)
    _, good = recorder.pair(2)

    def react(event: Event) -> None:
        if isinstance(event, DataReceived) and event.conn == 1:
            raise RuntimeError("a bug in the driver's code for connection 1")

    recorder.react = react
    bad.send(b"boom")
    good.send(b"fine")
    with trio.fail_after(TIMEOUT):
        await recorder.until(lambda: recorder.data(2) == b"fine" and bool(recorder.closed))
    assert recorder.failed == [(1, "reactor")]
    assert [(c.conn, c.error) for c in recorder.closed] == [(1, "internal error")]
    assert len({f.round for f in recorder.fed}) == 1
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(bad) == b""


@pytest.mark.parametrize("source", ["core", "driver with raise_errors"])
async def test_an_exception_out_of_the_core_or_with_raise_errors_crashes_the_reactor(
    source: str,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        recorder = Recorder(make_core(), listener)
        recorder.raise_errors = source != "core"
        _, peer = recorder.pair(1)

        def react(event: Event) -> None:
            if source == "core":
                # An event the core has no handler for: KeyError out of ProxyCore.handle.
                recorder.core.handle(Event(now=event.now))
            raise LookupError("a bug in the driver")

        recorder.react = react
        peer.send(b"x")
        with trio.fail_after(TIMEOUT), pytest.raises(LookupError) as raised:
            await recorder.reactor.run()
        recorder.close_peers()
    assert type(raised.value) is (KeyError if source == "core" else LookupError)
    assert recorder.failed == []
    assert recorder.ended_without_settle == 1 and recorder.settled == 0
    assert [r.conn for r in recorder.released] == [1], "run's end closes every socket"


# -- rounds ----------------------------------------------------------------------------------


async def test_a_socket_reusing_a_number_closed_in_the_round_is_not_served_in_it(
    recorder: Recorder,
) -> None:
    _, one = recorder.pair(1)
    _, two = recorder.pair(2)
    listener = socket.create_server(("127.0.0.1", 0))
    newcomer_peer = socket.create_connection(listener.getsockname())
    newcomer, _ = listener.accept()
    listener.close()
    newcomer_peer.send(b"new")
    replaced_in: list[int] = []

    def react(event: Event) -> None:
        if isinstance(event, DataReceived) and not replaced_in:
            # The other socket was ready too: close it, and give its number to a newcomer
            # whose input is waiting. The round's stale event for that number is not its.
            other = recorder.conns[3 - event.conn]
            number = other.fd
            recorder.reactor.close(other)
            os.dup2(newcomer.fileno(), number)
            recorder.add(3, socket.socket(fileno=number))
            replaced_in.append(recorder.rounds)

    recorder.react = react
    try:
        one.send(b"one")
        two.send(b"two")
        with trio.fail_after(TIMEOUT):
            await recorder.until(lambda: recorder.data(3) == b"new")
    finally:
        newcomer.close()
        newcomer_peer.close()
    (replaced,) = replaced_in
    (fed,) = [f for f in recorder.fed if getattr(f.event, "conn", None) == 3]
    assert fed.round > replaced
    assert len(recorder.fed) == 2, "the closed socket was not read after its close"


async def test_the_end_of_run_closes_every_socket() -> None:
    async with recording() as recorder:
        conn, _ = recorder.pair(1)
        recorder.pair(2)
        lingering, _ = recorder.pair(3, linger=True)
        recorder.reactor.close(lingering)
        recorder.send(conn, pattern(MIB))  # never written: nobody asks for write_queued
        with trio.fail_after(TIMEOUT):
            await trio.testing.wait_all_tasks_blocked()
    assert sorted(r.conn for r in recorder.released) == [1, 2, 3]
    assert [c.conn for c in recorder.closed] == [3], "run's end reports nothing more"
