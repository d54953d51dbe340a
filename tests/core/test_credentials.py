"""One spelling per credential, one field per request (``muxproxy.core.http.credentials``), and
the tenant budgets that rely on it (``admit.py``), driven with bytes only.

Every spelling of one credential (RFC 9110 §11.1: the auth-scheme is case-insensitive; OWS
around and after it is not part of it) is one tenant, so none escapes the budget the first
spent; a request with two Authorization fields, or two of its tenant's header, is refused
with 400, on HTTP/1.1 and on its own HTTP/2 stream. Through the core, each request is a
conversation: every command the core returns is asserted in order, timers included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h2.events
import pytest
from checks import Check, both, h1_request, h1_response, h2_body, h2_ended
from hypothesis import given, settings
from hypothesis import strategies as st
from playbook import H2ClientPeer, Sends, data
from test_routing_exchange import A, Routing, fleet

from muxproxy.config import RateLimit, SessionSource
from muxproxy.core.commands import CancelTimer, CloseConnection, SetTimer
from muxproxy.core.exchange.admit import tenant_of
from muxproxy.core.http.credentials import credential_key, normal_credentials

AUTHORIZATION = SessionSource(kind="header", name="authorization")

_OWS = st.text(alphabet=" \t", max_size=2)
_GAP = st.text(alphabet=" \t", min_size=1, max_size=4)
_TOKEN68 = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/",
    min_size=1,
    max_size=20,
).map(lambda text: text + "==")


@st.composite
def spellings(draw: st.DrawFn, scheme: str = "Bearer", credentials: str = "k-1") -> str:
    """``scheme credentials`` as a client may spell it: any case of the scheme, any run of
    SP / HTAB after it, OWS around it."""
    cased = "".join(c.upper() if draw(st.booleans()) else c.lower() for c in scheme)
    return draw(_OWS) + cased + draw(_GAP) + credentials + draw(_OWS)


@given(spelling=spellings(), token=_TOKEN68)
def test_every_spelling_of_one_credential_is_one_key(spelling: str, token: str) -> None:
    assert normal_credentials(spelling.encode()) == b"bearer k-1"
    assert credential_key(b"authorization", spelling.encode()) == b"bearer k-1"
    other = spelling.replace("k-1", token).encode()
    assert normal_credentials(other) == b"bearer " + token.encode()
    # The credentials themselves are case-sensitive (a token68): never merged.
    assert normal_credentials(b"Bearer K-1") != normal_credentials(b"Bearer k-1")


def test_a_bare_value_is_kept_as_sent_and_other_fields_only_trimmed() -> None:
    # A raw key in Authorization (no scheme) is case-sensitive: not lower-cased.
    assert normal_credentials(b"sk-ABC") == b"sk-ABC"
    assert normal_credentials(b"\tsk-ABC ") == b"sk-ABC"
    assert credential_key(b"x-api-key", b" Key  ABC ") == b"Key  ABC"
    assert credential_key(b"proxy-authorization", b"BASIC  dXNlcg==") == b"basic dXNlcg=="


# -- through the core ----------------------------------------------------------------------------

MODELS = h1_request(b"GET", b"/v1/models")


def raw_request(headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HTTP/1.1 GET written byte by byte (h11 would not write OWS around a value)."""
    lines = [b"GET /v1/models HTTP/1.1", b"host: proxy.example"]
    lines += [name + b":" + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def answers(
    rig: Routing, headers: list[tuple[bytes, bytes]], status: int | None, *, parsed: bool = True
) -> None:
    """One request on a new connection: the proxy answers ``status`` itself and opens no
    connection, or (``None``) the request goes to server A, which answers 200. ``parsed``:
    the head was taken (its deadline ends); a head the parser refuses just closes."""
    pb = rig.pb
    conn, client = rig.connect()
    pb >> data(conn, raw_request(headers))
    if parsed:
        pb << CancelTimer(timer=("header", conn))
    if status is None:
        up = rig.attempt(conn, to=A)
        rig.accept(up.conn, conn, MODELS)
        rig.reply(up.conn, conn, client)
        return
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << Sends(conn, client, h1_response(status, end=True))
    pb << CloseConnection(conn=conn)
    pb.done()  # no OpenConnection


@settings(max_examples=40, deadline=None)
@given(first=spellings(), second=spellings())
def test_no_spelling_of_a_credential_escapes_its_request_budget(first: str, second: str) -> None:
    rig = Routing(fleet(A, tenant=AUTHORIZATION, rate_limit=RateLimit(requests_per_minute=1)))
    answers(rig, [(b"authorization", first.encode())], None)
    answers(rig, [(b"authorization", second.encode())], 429)
    # Another credential has a budget of its own.
    answers(rig, [(b"authorization", b"Bearer k-2")], None)


def test_the_tenant_hash_is_of_the_one_spelling() -> None:
    assert tenant_of(normal_credentials(b"bearer  k")) == tenant_of(b"bearer k")


@pytest.mark.parametrize(
    "headers",
    [
        [(b"authorization", b"Bearer k"), (b"authorization", b"Bearer j")],
        [(b"authorization", b"Bearer k"), (b"authorization", b"Bearer k")],
    ],
)
def test_two_authorization_fields_are_refused_before_any_backend(
    headers: list[tuple[bytes, bytes]],
) -> None:
    # Even on a group with no tenant: which of the two a backend believes is its choice.
    rig = Routing(fleet(A))
    answers(rig, headers, 400, parsed=False)


def test_two_fields_of_the_tenant_header_are_refused() -> None:
    tenant = SessionSource(kind="header", name="x-api-key")
    rig = Routing(fleet(A, tenant=tenant, rate_limit=RateLimit(requests_per_minute=5)))
    answers(rig, [(b"x-api-key", b"k"), (b"x-api-key", b"j")], 400)
    answers(rig, [(b"x-api-key", b"k"), (b"x-other", b"j")], None)


def h2_statuses(expected: dict[int, bytes]) -> Check:
    """HTTP/2 response heads exactly on these streams, with these statuses; no GOAWAY."""

    def check(events: Sequence[Any]) -> None:
        heads = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
        assert {e.stream_id: dict(e.headers)[b":status"] for e in heads} == expected, events
        assert len(heads) == len(expected), events
        assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events), events

    return check


def test_over_http2_only_the_stream_with_two_authorization_fields_is_refused() -> None:
    rig = Routing(fleet(A, tenant=AUTHORIZATION, rate_limit=RateLimit(requests_per_minute=5)))
    pb = rig.pb
    conn, _ = rig.connect()
    client = H2ClientPeer()
    two = [(b"authorization", b"Bearer k"), (b"authorization", b"Bearer j")]
    bad, request = client.request(headers=two)
    good, more = client.request(headers=[(b"authorization", b"bearer  k")])
    pb >> data(conn, client.preface() + request + more)
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << Sends(conn, client, h2_statuses({bad: b"400"}))  # SETTINGS, the ack, one refusal
    pb << CancelTimer(timer=("header", conn))
    up = rig.attempt(conn, to=A)  # the other stream goes on to the backend
    pb.done()
    rig.accept(up.conn, conn, MODELS)
    pb >> data(up.conn, rig.response_bytes(up.conn))
    pb << CancelTimer(timer=("head", conn))
    pb << Sends(conn, client, h2_statuses({good: b"200"}))
    pb << SetTimer(timer=("read", conn), at=pb.now + rig.read_s)
    pb << Sends(conn, client, both(h2_ended(good), lambda events: h2_body(events, good) == b"ok"))
    pb << CloseConnection(conn=up.conn)
    pb << CancelTimer(timer=("read", conn))
    pb << SetTimer(timer=("idle", conn), at=pb.now + rig.idle_s)
    pb.done()
