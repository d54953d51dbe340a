"""Checks for the Playbook's ``Sends``: what a real peer decoded from the proxy's bytes.

Each function returns a check for ``Sends(conn, peer, check)``: it gets the events the peer
decoded from one run of ``SendData`` and asserts on them, so a conversation reads::

    pb >> data(1, client.request())
    pb << Sends(1, client, h1_response(431))
    pb << CloseConnection(conn=1)

The HTTP/1.1 checks take the events of ``H1ClientPeer`` (or ``H1BackendPeer``), the HTTP/2
ones those of ``H2ClientPeer`` (or ``H2BackendPeer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import h2.events
import h11

Check = Callable[[Sequence[Any]], None]


def h1_body(events: Sequence[Any]) -> bytes:
    """The body bytes among HTTP/1.1 ``events``."""
    return b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))


def h1_response(
    status: int,
    body: bytes | None = None,
    *,
    end: bool | None = None,
    headers: dict[bytes, bytes] | None = None,
) -> Check:
    """One HTTP/1.1 response head of ``status`` first; ``body``: its body bytes are these;
    ``end``: whether the last event is its EndOfMessage (None: not checked); ``headers``:
    items its head holds."""

    def check(events: Sequence[Any]) -> None:
        assert events, "nothing decoded"
        head = events[0]
        assert isinstance(head, h11.Response), events
        assert head.status_code == status, head
        assert sum(isinstance(e, h11.Response) for e in events) == 1, events
        if body is not None:
            assert h1_body(events) == body, events
        if end is not None:
            assert isinstance(events[-1], h11.EndOfMessage) is end, events
        if headers is not None:
            held = dict(head.headers)
            for name, value in headers.items():
                assert held.get(name) == value, (name, head.headers)

    return check


def h1_request(
    method: bytes | None = None, target: bytes | None = None, body: bytes | None = None
) -> Check:
    """One whole HTTP/1.1 request (a backend's view): head, ``body`` if given, its end."""

    def check(events: Sequence[Any]) -> None:
        assert events and isinstance(events[0], h11.Request), events
        if method is not None:
            assert events[0].method == method, events[0]
        if target is not None:
            assert events[0].target == target, events[0]
        if body is not None:
            assert h1_body(events) == body, events
        assert isinstance(events[-1], h11.EndOfMessage), events

    return check


def on_stream(events: Sequence[Any], sid: int) -> list[Any]:
    """The HTTP/2 ``events`` of stream ``sid``."""
    return [e for e in events if getattr(e, "stream_id", None) == sid]


def h2_body(events: Sequence[Any], sid: int) -> bytes:
    return b"".join(e.data for e in on_stream(events, sid) if isinstance(e, h2.events.DataReceived))


def h2_response(
    sid: int,
    status: int,
    body: bytes | None = None,
    *,
    ended: bool | None = None,
    reset: int | None = None,
) -> Check:
    """Stream ``sid``'s one response head of ``status``; ``body``: its DATA is these bytes;
    ``ended``: whether END_STREAM came (None: not checked); ``reset``: the stream was reset
    with this error code."""

    def check(events: Sequence[Any]) -> None:
        mine = on_stream(events, sid)
        heads = [e for e in mine if isinstance(e, h2.events.ResponseReceived)]
        assert len(heads) == 1, mine
        assert dict(heads[0].headers)[b":status"] == str(status).encode(), heads[0]
        if body is not None:
            assert h2_body(events, sid) == body, mine
        if ended is not None:
            assert any(isinstance(e, h2.events.StreamEnded) for e in mine) is ended, mine
        if reset is not None:
            assert [e.error_code for e in mine if isinstance(e, h2.events.StreamReset)] == [
                reset
            ], mine

    return check


def h2_ended(sid: int) -> Check:
    """Stream ``sid`` ended (END_STREAM), not reset."""

    def check(events: Sequence[Any]) -> None:
        mine = on_stream(events, sid)
        assert any(isinstance(e, h2.events.StreamEnded) for e in mine), events
        assert not any(isinstance(e, h2.events.StreamReset) for e in mine), events

    return check


def h2_resets(*expected: tuple[int, int]) -> Check:
    """Exactly these (stream id, error code) RST_STREAMs, in order, and no GOAWAY."""

    def check(events: Sequence[Any]) -> None:
        got = [(e.stream_id, e.error_code) for e in events if isinstance(e, h2.events.StreamReset)]
        assert got == list(expected), events
        assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events), events

    return check


def h2_goaway(code: int, last_stream_id: int | None = None) -> Check:
    """A GOAWAY with ``code`` (and ``last_stream_id``) among the events."""

    def check(events: Sequence[Any]) -> None:
        goaways = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaways, events
        assert goaways[-1].error_code == code, goaways
        if last_stream_id is not None:
            assert goaways[-1].last_stream_id == last_stream_id, goaways

    return check


def both(*checks: Check) -> Check:
    """Every one of ``checks``."""

    def check(events: Sequence[Any]) -> None:
        for one in checks:
            one(events)

    return check
