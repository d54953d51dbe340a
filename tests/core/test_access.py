"""The access record and X-Request-ID (``muxproxy.core.observe.access``), driven with bytes only."""

from __future__ import annotations

from typing import Any

import attrs
import h2.events
import h11
import pytest
from checks import h1_body, h1_request, h1_response, h2_ended, h2_response
from playbook import (
    ANY,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    data,
    default_config,
    opened,
    sent,
)

from muxproxy.config import Route, SessionSource, Sticky
from muxproxy.core.commands import CancelTimer, CloseConnection, Log, OpenConnection, SetTimer
from muxproxy.core.observe.access import MAX_REQUEST_ID, RequestIds, is_sane_id, session_hash


def access(pb: Playbook) -> dict[str, Any]:
    (record,) = [c for c in pb.log if isinstance(c, Log) and c.event == "access"]
    return record.fields


def exchange(
    pb: Playbook,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b'{"m":1}',
    *,
    model_read: bool = False,
) -> tuple[h11.Request, h11.Response]:
    """One HTTP/1.1 POST answered 200 by the backend; what the backend and client saw.
    ``model_read``: its body is read for its model before it is routed (its ``body`` timer
    is armed first)."""
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    pb >> data(1, client.request("POST", "/v1/chat/completions", headers=headers, body=body))
    pb << CancelTimer(timer=("header", 1))
    if model_read:
        pb << SetTimer(timer=("body", 1), at=30.0)
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    if not model_read:
        pb << SetTimer(timer=("body", 1), at=30.0)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (forwarded := Sends(-1, backend, h1_request(b"POST", body=body)))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> sent(-1, len(forwarded.data))
    answer = backend.conn.send(
        h11.Response(status_code=200, headers=[("Content-Length", "5"), ("X-Request-ID", "b")])
    )
    pb >> data(-1, (answer or b"") + (backend.chunk(b"hello")) + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (reply := Sends(1, client, h1_response(200)))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, lambda events: h1_body(events) == b"hello")
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    request, response = forwarded.events[0], reply.events[0]
    assert isinstance(request, h11.Request) and isinstance(response, h11.Response)
    return request, response


def request_ids(message: h11.Request | h11.Response) -> list[bytes]:
    return [v for n, v in message.headers if n == b"x-request-id"]


def test_a_request_without_an_id_gets_one_sent_both_ways_and_logged() -> None:
    pb = Playbook()
    request, response = exchange(pb)
    (sent,) = request_ids(request)
    assert request_ids(response) == [sent]  # the backend's own "b" is replaced by ours
    fields = access(pb)
    assert fields["request_id"] == sent.decode()
    prefix = pb.core.request_ids.prefix
    assert sent == prefix + b"-1"
    assert len(prefix) == 12 and is_sane_id(sent)
    assert fields["bytes_in"] == 7 and fields["bytes_out"] == 5


def test_a_sane_client_id_is_kept_end_to_end() -> None:
    pb = Playbook()
    request, response = exchange(pb, headers=[("X-Request-ID", "trace-0af7651916cd43dd")])
    assert request_ids(request) == request_ids(response) == [b"trace-0af7651916cd43dd"]
    assert access(pb)["request_id"] == "trace-0af7651916cd43dd"


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Request-ID", "has space")],
        [("X-Request-ID", "x" * (MAX_REQUEST_ID + 1))],
        [("X-Request-ID", "a\tb")],
        [("X-Request-ID", "one"), ("X-Request-ID", "two")],
    ],
)
def test_an_insane_client_id_is_replaced(headers: list[tuple[str, str]]) -> None:
    pb = Playbook()
    request, response = exchange(pb, headers=headers)
    expected = pb.core.request_ids.prefix + b"-1"
    assert request_ids(request) == request_ids(response) == [expected]


def test_generated_ids_differ_between_processes_and_requests() -> None:
    a, b = RequestIds(), RequestIds()
    assert a.prefix != b.prefix
    assert a.new() != a.new()


def test_the_proxy_own_error_carries_the_request_id() -> None:
    pb = Playbook(default_config(routes=(Route(prefix="/v1/", upstream="default"),)))
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/x", headers=[("X-Request-ID", "abc")]))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(404, headers={b"x-request-id": b"abc"}))
    pb << CloseConnection(conn=1)
    pb.done()
    fields = access(pb)
    assert fields["request_id"] == "abc" and fields["group"] is None and fields["server"] is None
    assert fields["bytes_out"] > 0 and fields["tries"] == 0


def test_the_session_field_is_a_hash_of_the_key_never_the_key() -> None:
    config = default_config()
    group = attrs.evolve(
        config.upstreams["default"],
        sticky=Sticky(sources=(SessionSource(kind="header", name="x-session-id"),)),
    )
    pb = Playbook(attrs.evolve(config, upstreams={"default": group}))
    exchange(pb, headers=[("X-Session-ID", "conversation-42")])
    fields = access(pb)
    assert fields["session"] == session_hash(b"conversation-42")
    assert len(fields["session"]) == 16
    assert "conversation-42" not in repr(fields)


def test_an_h2_client_is_logged_as_version_2() -> None:
    pb = Playbook()
    client, backend = H2ClientPeer(), H1BackendPeer()
    pb.accept(1)
    pb.receive(1, client.preface())
    client.events(pb.take(1))
    sid, request = client.request(headers=[(b"x-request-id", b"h2-id")])
    pb >> data(1, request)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (forwarded := Sends(-1, backend, h1_request(b"GET", b"/v1/models")))
    assert request_ids(forwarded.events[0]) == [b"h2-id"]
    pb << SetTimer(timer=("head", 1), at=60.0)
    answer = backend.conn.send(h11.Response(status_code=204, headers=[]))
    pb >> data(-1, (answer or b"") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << (reply := Sends(1, client, h2_response(sid, 204)))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, h2_ended(sid))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    received = [e for e in reply.events if isinstance(e, h2.events.ResponseReceived)]
    assert (b"x-request-id", b"h2-id") in received[0].headers
    fields = access(pb)
    assert fields["version"] == "2" and fields["upstream_version"] == "1.1"
    assert fields["status"] == 204
