"""The Date field (RFC 9110 §6.6.1): ``muxproxy.core.http.dates`` and the responses that carry it.

The core has no clock: the driver's ``wall`` on ``ConnectionAccepted`` says what wall-clock
time its monotonic ``now`` is, so these tests pick both and know the exact Date to expect.
"""

from __future__ import annotations

import email.utils
import random

import h2.events
import h11
import pytest
from checks import h1_body, h1_request, h1_response, h2_body, h2_response
from playbook import (
    ANY,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    Where,
    data,
    default_config,
    open_failed,
    opened,
    subset,
)
from test_tunnel import send_extended_connect

from muxproxy.config import Route
from muxproxy.core.commands import CancelTimer, CloseConnection, Log, OpenConnection, SetTimer
from muxproxy.core.http.dates import HttpDate, imf_fixdate
from muxproxy.core.tunnel.websocket import accept_for

# RFC 9110 §5.6.7's example: 784111777 is "Sun, 06 Nov 1994 08:49:37 GMT".
WALL = 784111777.0
DATE = b"Sun, 06 Nov 1994 08:49:37 GMT"


def test_http_date_is_imf_fixdate_from_the_offset() -> None:
    date = HttpDate()
    assert date.at(5.0) is None  # no wall time given: no clock, no Date
    date.set_wall(100.0, WALL)
    assert date.at(100.0) == DATE
    assert date.at(100.999) == DATE
    assert date.at(101.0) == b"Sun, 06 Nov 1994 08:49:38 GMT"
    assert date.at(100.0 + 86400) == b"Mon, 07 Nov 1994 08:49:37 GMT"


def test_http_date_is_formatted_once_per_second() -> None:
    date = HttpDate()
    date.set_wall(0.0, WALL)
    first = date.at(0.1)
    assert date.at(0.9) is first  # the cached bytes, not a new string
    assert date.at(1.2) is not first


@pytest.mark.parametrize(
    "second",
    [
        0,
        784111777,  # RFC 9110 §5.6.7's example
        951782400,  # 2000-02-29, a leap day of a century year
        1704067199,  # 2023-12-31 23:59:59
        1704067200,  # 2024-01-01 00:00:00
        4107542399,  # 2100-02-28 23:59:59 (2100 is not a leap year)
        253402300799,  # 9999-12-31 23:59:59, the last four-digit year
    ],
)
def test_imf_fixdate_is_the_standard_library_format(second: int) -> None:
    """The same bytes as ``email.utils.formatdate(usegmt=True)``, which the core no longer
    imports (the email package in every serving process, for one line)."""
    assert imf_fixdate(second) == email.utils.formatdate(second, usegmt=True).encode("ascii")


def test_imf_fixdate_agrees_with_the_standard_library_anywhere() -> None:
    for second in random.Random(9110).sample(range(253402300800), 2000):
        assert imf_fixdate(second) == email.utils.formatdate(second, usegmt=True).encode()


def _h1_response(
    pb: Playbook, client: H1ClientPeer, headers: list[tuple[str, str]]
) -> h11.Response:
    """A GET whose backend answers, 2.5 s after the accept, with ``headers`` and a body:
    the head the client got."""
    backend = H1BackendPeer()
    t = pb.now
    pb >> data(1, client.request("GET", "/v1/models"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=t + 5)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, h1_request(b"GET", b"/v1/models"))
    pb << SetTimer(timer=("head", 1), at=t + 60)
    pb.now += 2.5
    head = backend.conn.send(h11.Response(status_code=200, headers=headers)) or b""
    pb >> data(-1, head + backend.chunk(b"{}") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=t + 62.5)
    pb << (response := Sends(1, client, h1_response(200)))
    pb << SetTimer(timer=("read", 1), at=t + 302.5)
    pb << Sends(1, client, lambda events: h1_body(events) == b"{}")
    pb << SetTimer(timer=("pool", -1), at=t + 62.5)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=t + 77.5)
    pb.done()
    head_event = response.events[0]
    assert isinstance(head_event, h11.Response)
    return head_event


def test_backend_response_without_date_gets_the_proxys() -> None:
    pb = Playbook()
    pb.now = 10.0
    pb.accept(1, wall=WALL)
    client = H1ClientPeer()
    response = _h1_response(pb, client, [("Content-Type", "application/json")])
    dates = [v for n, v in response.headers if n == b"date"]
    # Two and a half seconds after the accept.
    assert dates == [b"Sun, 06 Nov 1994 08:49:39 GMT"]


def test_backend_date_is_kept() -> None:
    pb = Playbook()
    pb.accept(1, wall=WALL)
    client = H1ClientPeer()
    theirs = "Tue, 01 Dec 2026 12:00:00 GMT"
    response = _h1_response(pb, client, [("Date", theirs)])
    assert [v for n, v in response.headers if n == b"date"] == [theirs.encode()]


def test_no_date_without_a_wall_clock() -> None:
    pb = Playbook()
    pb.accept(1)
    response = _h1_response(pb, H1ClientPeer(), [])
    assert [v for n, v in response.headers if n == b"date"] == []


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_h1_own_404_has_a_date_and_logs_its_bytes(method: str) -> None:
    pb = Playbook(default_config(routes=(Route(prefix="/v1/", upstream="default"),)), ignore=())
    pb.accept(1, wall=WALL)
    client = H1ClientPeer()
    pb >> data(1, client.request(method, "/other"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (reply := Sends(1, client, h1_response(404, headers={b"date": DATE})))
    body = h1_body(reply.events)
    pb << Log(event="access", fields=subset({"status": 404, "bytes_out": len(body)}))
    pb << CloseConnection(conn=1)
    pb.done()
    if method == "GET":
        assert len(body) == int(dict(reply.events[0].headers)[b"content-length"]) > 0
    else:
        assert body == b""


def test_h2_own_404_has_a_date_and_logs_its_bytes() -> None:
    pb = Playbook(default_config(routes=(Route(prefix="/v1/", upstream="default"),)), ignore=())
    pb.accept(1, wall=WALL)
    client = H2ClientPeer()
    sid, request = client.request(b"GET", b"/other")
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client)  # our SETTINGS
    pb << CancelTimer(timer=("header", 1))
    pb << (reply := Sends(1, client, h2_response(sid, 404, ended=True)))
    (head,) = [e for e in reply.events if isinstance(e, h2.events.ResponseReceived)]
    headers = dict(head.headers)
    assert headers[b"date"] == DATE
    body = h2_body(reply.events, sid)
    assert len(body) == int(headers[b"content-length"]) > 0
    pb << Log(event="access", fields=subset({"status": 404, "bytes_out": len(body)}))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_own_502_has_a_date() -> None:
    pb = Playbook(ignore=())
    pb.accept(1, wall=WALL)
    client = H1ClientPeer()
    pb >> data(1, client.request("GET", "/v1/models"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb >> open_failed(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(502, headers={b"date": DATE}))
    pb << Where(Log, lambda log: log.event == "access" and log.fields["bytes_out"] > 0)
    pb << CloseConnection(conn=1)
    pb.done()


def test_extended_connect_200_gets_a_date() -> None:
    # RFC 8441 §5: the tunnel opens with a 2xx, which RFC 9110 §6.6.1 dates; the HTTP/1.1
    # backend's 101 behind it (a 1xx) carries none.
    pb = Playbook()
    peer = H2ClientPeer()
    sid, up = send_extended_connect(pb, peer, wall=WALL)
    backend = H1BackendPeer()
    (request, _) = backend.events(pb.take(up))
    key = dict(request.headers)[b"sec-websocket-key"]
    switch = h11.InformationalResponse(
        status_code=101,
        headers=[
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            ("Sec-WebSocket-Accept", accept_for(key).decode()),
        ],
    )
    pb >> data(up, backend.conn.send(switch) or b"")
    pb << CancelTimer(timer=("head", sid))
    pb << (opening := Sends(1, peer, h2_response(sid, 200, ended=False)))
    pb << SetTimer(timer=("tunnel", 1), at=3600.0)
    pb.done()
    (response,) = [e for e in opening.events if isinstance(e, h2.events.ResponseReceived)]
    assert [v for n, v in response.headers if n == b"date"] == [DATE]
