"""Forwarded fields and the client's request id (``muxproxy.core.http.forwarded``, ``access.py``),
driven with bytes only: a real h11 (or h2) client, the request the h11 backend receives.

From a peer outside the listener's ``trusted_proxies`` (by default every peer), the client's
X-Forwarded-*, Forwarded and X-Real-IP are dropped and X-Forwarded-For / -Proto set from the
connection; from a trusted proxy the chain is appended to (RFC 7239 §4 for Forwarded).
"""

from __future__ import annotations

import ipaddress
from typing import Any

import h11
import pytest
from checks import h1_request, h1_response
from playbook import (
    ANY,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    Where,
    data,
    opened,
    sent,
    subset,
)

from muxproxy.core.commands import CancelTimer, Log, OpenConnection, SetTimer
from muxproxy.core.http.forwarded import forwarded_fields, is_trusted
from muxproxy.core.observe.access import MAX_REQUEST_ID

LB = "10.0.0.7"
"""The peer the client connects from (a load balancer, when trusted)."""
TRUSTED = (ipaddress.ip_network("10.0.0.0/8"),)

CLAIMS = [
    ("X-Forwarded-For", "203.0.113.9"),
    ("X-Forwarded-For", "198.51.100.2"),
    ("X-Forwarded-Proto", "https"),
    ("X-Forwarded-Host", "admin.internal"),
    ("X-Forwarded-Port", "443"),
    ("Forwarded", 'for=203.0.113.9;proto=https, for="[2001:db8::1]"'),
    ("X-Real-IP", "203.0.113.9"),
]
"""What a client (or the proxy in front) says about the hops before."""


def forwarded_upstream(
    headers: list[tuple[str, str]],
    *,
    peer: str = LB,
    trusted: tuple[Any, ...] = (),
    tls: bool = False,
) -> dict[bytes, list[bytes]]:
    """One HTTP/1.1 GET from ``peer`` on a listener trusting ``trusted``: the fields the
    backend received (name -> values, in order)."""
    pb = Playbook()
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1, peer=(peer, 5555), trusted_proxies=trusted, tls=tls)
    pb >> data(1, client.request("GET", "/v1/models", headers=headers))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, backend, h1_request(b"GET", b"/v1/models")))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb.done()
    return fields_of(request.events[0])


def fields_of(head: Any) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for name, value in head.headers:
        out.setdefault(bytes(name), []).append(bytes(value))
    return out


def test_an_untrusted_peers_forwarded_fields_are_dropped_and_set_from_the_connection() -> None:
    seen = forwarded_upstream(CLAIMS)
    assert seen[b"x-forwarded-for"] == [LB.encode()]
    assert seen[b"x-forwarded-proto"] == [b"http"]
    for name in (b"x-forwarded-host", b"x-forwarded-port", b"forwarded", b"x-real-ip"):
        assert name not in seen


def test_the_default_trusts_even_a_loopback_peer_nothing() -> None:
    seen = forwarded_upstream(CLAIMS, peer="127.0.0.1")
    assert seen[b"x-forwarded-for"] == [b"127.0.0.1"]
    assert b"x-real-ip" not in seen and b"forwarded" not in seen


def test_a_trusted_proxys_chain_is_appended_to_and_its_fields_kept() -> None:
    seen = forwarded_upstream(CLAIMS, trusted=TRUSTED)
    assert seen[b"x-forwarded-for"] == [b"203.0.113.9, 198.51.100.2, " + LB.encode()]
    # It terminated the client's TLS: its word on the scheme, host and port stands.
    assert seen[b"x-forwarded-proto"] == [b"https"]
    assert seen[b"x-forwarded-host"] == [b"admin.internal"]
    assert seen[b"x-forwarded-port"] == [b"443"]
    assert seen[b"x-real-ip"] == [b"203.0.113.9"]
    # RFC 7239 §4: our element appended to the list.
    assert seen[b"forwarded"] == [
        b'for=203.0.113.9;proto=https, for="[2001:db8::1]", for=10.0.0.7;proto=http'
    ]


def test_a_trusted_proxy_that_sent_nothing_gets_the_connection_facts() -> None:
    seen = forwarded_upstream([], trusted=TRUSTED, tls=True)
    assert seen[b"x-forwarded-for"] == [LB.encode()]
    assert seen[b"x-forwarded-proto"] == [b"https"]
    assert b"forwarded" not in seen  # the proxy starts no Forwarded of its own


def test_a_peer_outside_the_trusted_networks_is_not_trusted() -> None:
    seen = forwarded_upstream(CLAIMS, peer="192.0.2.1", trusted=TRUSTED)
    assert seen[b"x-forwarded-for"] == [b"192.0.2.1"]
    assert b"x-real-ip" not in seen


def test_a_forwarded_field_nominated_by_connection_is_dropped_even_from_a_trusted_proxy() -> None:
    headers = [*CLAIMS, ("Connection", "x-real-ip, x-forwarded-for")]
    seen = forwarded_upstream(headers, trusted=TRUSTED)
    assert seen[b"x-forwarded-for"] == [LB.encode()]
    assert b"x-real-ip" not in seen


def test_an_h2_clients_claims_are_dropped_too() -> None:
    pb = Playbook()
    client, backend = H2ClientPeer(), H1BackendPeer()
    pb.accept(1)
    claims = [(name.lower().encode(), value.encode()) for name, value in CLAIMS]
    _, request = client.request(headers=claims)
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client)  # our SETTINGS
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb << Sends(1, client)  # the SETTINGS ACK
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (forwarded := Sends(-1, backend, h1_request(b"GET", b"/v1/models")))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb.done()
    seen = fields_of(forwarded.events[0])
    assert seen[b"x-forwarded-for"] == [LB.encode()]
    assert b"forwarded" not in seen and b"x-forwarded-host" not in seen


@pytest.mark.parametrize(
    ("peer", "networks", "trusted"),
    [
        ("10.1.2.3", ["10.0.0.0/8"], True),
        ("11.1.2.3", ["10.0.0.0/8"], False),
        ("::ffff:10.1.2.3", ["10.0.0.0/8"], True),  # an IPv4 peer on a dual-stack socket
        ("2001:db8::5", ["2001:db8::/32"], True),
        ("2001:db8::5", ["10.0.0.0/8"], False),
        ("unknown", ["0.0.0.0/0"], False),
        ("127.0.0.1", [], False),
    ],
)
def test_is_trusted(peer: str, networks: list[str], trusted: bool) -> None:
    assert is_trusted(peer, [ipaddress.ip_network(n) for n in networks]) is trusted


def test_an_ipv6_peer_is_quoted_in_its_forwarded_element() -> None:
    fields = forwarded_fields(
        [(b"forwarded", b"for=192.0.2.60")], peer_ip="2001:db8::7", proto=b"https", trusted=True
    )
    assert (b"forwarded", b'for=192.0.2.60, for="[2001:db8::7]";proto=https') in fields


# -- the client's request id ---------------------------------------------------------------------


def request_id_round_trip(value: str | None) -> tuple[bytes, bytes, list[Log]]:
    """The id the backend got, the one the client got back, and the replacement logs."""
    pb = Playbook(ignore=())
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    headers = [] if value is None else [("X-Request-ID", value)]
    replaced: list[Log] = []

    def replacement(log: Log) -> None:
        assert log.event == "request_id_replaced", log
        replaced.append(log)

    pb >> data(1, client.request("GET", "/v1/models", headers=headers))
    pb << CancelTimer(timer=("header", 1))
    if pb.queue and isinstance(pb.queue[0], Log):  # the tests say whether one must be here
        pb << Where(Log, replacement)
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, backend, h1_request(b"GET", b"/v1/models")))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> sent(-1, len(request.data))
    answer = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
    pb >> data(-1, (answer or b"") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (response := Sends(1, client, h1_response(200, b"", end=True)))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << Log(event="access", fields=subset({"status": 200, "outcome": "ok"}))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    upstream = dict(request.events[0].headers)[b"x-request-id"]
    back = dict(response.events[0].headers)[b"x-request-id"]
    return upstream, back, replaced


@pytest.mark.parametrize(
    "value",
    [
        "0af7651916cd43dd8448eb211c80319c",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "3f2a9c01-d4e5-4c3b-9a1e-7f00aa11bb22",
        "host.example:1234_a",
        "x" * MAX_REQUEST_ID,
    ],
)
def test_a_short_id_of_safe_characters_is_kept(value: str) -> None:
    upstream, back, logs = request_id_round_trip(value)
    assert upstream == back == value.encode() and not logs


@pytest.mark.parametrize(
    ("value", "logged"),
    [
        ("x" * (MAX_REQUEST_ID + 1), "x" * 64 + "...(129 bytes)"),
        ('a"b', "a\\x22b"),
        ("id;rm -rf", "id\\x3brm\\x20-rf"),
        ("a=b/c+d", "a\\x3db\\x2fc\\x2bd"),
        ("%0d%0aforged=1", "\\x250d\\x250aforged\\x3d1"),
    ],
)
def test_any_other_id_is_replaced_and_logged_escaped(value: str, logged: str) -> None:
    upstream, back, logs = request_id_round_trip(value)
    assert upstream == back and upstream != value.encode()
    (log,) = logs
    assert log.fields == {
        "request_id": upstream.decode(),
        "client_request_id": logged,
        "client": LB,
    }


def test_no_id_gets_one_without_a_log() -> None:
    upstream, back, logs = request_id_round_trip(None)
    assert upstream == back and not logs
