"""``core/upstream/probes.py`` as whole conversations: active health checks.

The rules under test: a check is a ``GET <path>`` over a pooled backend connection (the next
check reuses it, RFC 9112 §9.3); ``fails`` failed checks in a row take the server down, which
requests then see as no usable backend (503, RFC 9110 §15.6.4) without a connect; a check
that gets no answer within ``timeout`` fails and closes its connection; a new configuration
retires the check in flight.
"""

from __future__ import annotations

import h11
from playbook import (
    BACKEND,
    H1BackendPeer,
    H1ClientPeer,
    Playbook,
    Sends,
    data,
    default_config,
    is_request,
    opened,
    subset,
    wakeup,
)

from muxproxy.config import Config, HealthCheck, Server, Upstream
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    Origin,
    SetTimer,
)
from muxproxy.core.events import ConfigChanged

ORIGIN = Origin(host="127.0.0.1", port=9001)
CHECK = HealthCheck(interval=5.0, timeout=2.0, passes=2, fails=2)


def checked() -> Config:
    group = Upstream(name="default", servers=(Server(address=BACKEND),), health_check=CHECK)
    return default_config(upstreams={"default": group})


def status(backend: H1BackendPeer, code: int) -> bytes:
    out = backend.conn.send(h11.Response(status_code=code, headers=[("Content-Length", "0")]))
    return (out or b"") + (backend.conn.send(h11.EndOfMessage()) or b"")


def first_check(pb: Playbook, backend: H1BackendPeer) -> None:
    """The configuration arrives; check 1 connects and sends its request."""
    pb >> ConfigChanged(now=pb.now, config=pb.core.config)
    pb << SetTimer(timer=("probe", 1), at=0.0)  # at once
    if Log not in pb.ignore:
        pb << Log(event="config_changed", fields={})
    pb >> wakeup("probe", 1)
    pb << SetTimer(timer=("probe_timeout", 1), at=2.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb >> opened(-1)

    def health_get(events: list[object]) -> None:
        is_request(b"/health")(events)
        request = events[0]
        assert isinstance(request, h11.Request)
        assert (b"user-agent", b"muxproxy-health") in request.headers

    pb << Sends(-1, backend, health_get)
    pb.done()


def answer(pb: Playbook, backend: H1BackendPeer, code: int, *, down: bool = False) -> None:
    """The backend answers the check in flight with ``code``: the connection is pooled and
    the next check scheduled; ``down``: this answer takes the server down."""
    pb >> data(-1, status(backend, code))
    pb << SetTimer(timer=("pool", -1), at=pb.now + 60.0)
    pb << CancelTimer(timer=("probe_timeout", 1))
    if down:
        pb << Log(event="health", fields=subset({"up": False, "detail": f"status {code}"}))
    pb << SetTimer(timer=("probe", 1), at=pb.now + 5.0)
    pb.done()
    backend.conn.start_next_cycle()


def next_check(pb: Playbook, backend: H1BackendPeer) -> None:
    """The next check goes over the pooled connection: no connect."""
    pb.now += 5.0
    pb >> wakeup("probe", 1)
    pb << SetTimer(timer=("probe_timeout", 1), at=pb.now + 2.0)
    pb << CancelTimer(timer=("pool", -1))
    pb << Sends(-1, backend, is_request(b"/health"))
    pb.done()


def test_a_passing_check_keeps_its_connection_for_the_next_one() -> None:
    pb = Playbook(checked(), ignore=())
    backend = H1BackendPeer()
    first_check(pb, backend)
    answer(pb, backend, 200)
    next_check(pb, backend)
    answer(pb, backend, 200)  # still up: no health record
    assert [c.conn for c in pb.opens()] == [-1]


def test_fails_failed_checks_take_the_server_down_and_requests_get_503() -> None:
    pb = Playbook(checked(), ignore=())
    backend = H1BackendPeer()
    first_check(pb, backend)
    answer(pb, backend, 503)  # one failure: still up
    next_check(pb, backend)
    answer(pb, backend, 503, down=True)
    client = H1ClientPeer()
    pb.accept(7)
    pb >> data(7, client.request())
    pb << CancelTimer(timer=("header", 7))
    pb << SetTimer(timer=("send", 7), at=pb.now + 60.0)
    reply = Sends(7, client)
    pb << reply
    outcome = "no backend available"
    pb << Log(event="access", fields=subset({"status": 503, "tries": 0, "outcome": outcome}))
    pb << CloseConnection(conn=7)  # once the exchange is over (Effects.defer)
    pb.done()  # no OpenConnection: the server is down
    assert reply.events[0].status_code == 503


def test_a_check_without_an_answer_times_out_and_closes_its_connection() -> None:
    pb = Playbook(checked())
    backend = H1BackendPeer()
    first_check(pb, backend)
    pb.now = 2.0
    pb >> wakeup("probe_timeout", 1)
    pb << CloseConnection(conn=-1)  # a late answer must not count for the next check
    pb << SetTimer(timer=("probe", 1), at=7.0)
    pb.done()


def test_a_new_configuration_retires_the_check_in_flight() -> None:
    pb = Playbook(checked())
    backend = H1BackendPeer()
    first_check(pb, backend)
    pb >> ConfigChanged(now=pb.now, config=checked())
    pb << CancelTimer(timer=("probe_timeout", 1))
    pb << CloseConnection(conn=-1)
    pb << SetTimer(timer=("probe", 2), at=0.0)  # the new configuration's own check
    pb.done()
    pb >> data(-1, status(backend, 503))  # too late: the retired check ignores it
    pb.done()
