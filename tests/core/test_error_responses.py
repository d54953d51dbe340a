"""The proxy's own error responses (``muxproxy.core.http.errors``): plain text, or the OpenAI shape
on ``api = "openai"`` routes, whichever side found the error."""

from __future__ import annotations

import json

import attrs
import h2.events
import h11
import pytest
from checks import h1_body, h1_response, h2_body, h2_ended
from playbook import (
    ANY,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    data,
    default_config,
    open_failed,
)

from muxproxy.config import Api, Config, Limits, Route
from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, SetTimer
from muxproxy.core.http.errors import error_response


@pytest.mark.parametrize(
    ("status", "kind", "code"),
    [
        (413, "invalid_request_error", "request_too_large"),
        (431, "invalid_request_error", "request_header_fields_too_large"),
        (429, "requests", "rate_limit_exceeded"),
        (502, "server_error", "bad_gateway"),
        (503, "server_error", "service_unavailable"),
        (504, "server_error", "gateway_timeout"),
        (418, "invalid_request_error", "http_418"),
        (599, "server_error", "http_599"),
    ],
)
def test_openai_error_object(status: int, kind: str, code: str) -> None:
    headers, body = error_response(status, "why it failed", api=Api.OPENAI, date=None)
    assert json.loads(body) == {
        "error": {"message": "why it failed", "type": kind, "param": None, "code": code}
    }
    assert headers == [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]


def test_plain_error_with_date() -> None:
    headers, body = error_response(502, "upstream unavailable", api=None, date=b"D")
    assert body == b"upstream unavailable\n"
    assert headers == [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"21"),
        (b"date", b"D"),
    ]


def config(**limits: int) -> Config:
    return default_config(
        routes=(
            Route(prefix="/v1/", upstream="default", api=Api.OPENAI),
            Route(prefix="/", upstream="default"),
        ),
        limits=attrs.evolve(Limits(), **limits),
    )


def h1_answer(
    pb: Playbook, request: bytes, *, head_read: bool = False
) -> tuple[int, dict[bytes, bytes], bytes]:
    """The proxy's own answer to ``request``, then the close, no backend asked for;
    ``head_read``: the head was taken whole (its wait ends) before the answer."""
    pb.accept(1)
    client = H1ClientPeer()
    client.request()  # the client peer only decodes: it expects a response
    pb >> data(1, request)
    if head_read:
        pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (reply := Sends(1, client, lambda events: isinstance(events[0], h11.Response)))
    pb << CloseConnection(conn=1)
    pb.done()
    response = reply.events[0]
    return response.status_code, dict(response.headers), h1_body(reply.events)


def h2_answer(
    pb: Playbook, path: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict[bytes, bytes], bytes]:
    """The proxy's own answer on the stream of a GET of ``path``, no backend asked for."""
    pb.accept(1)
    client = H2ClientPeer()
    sid, request = client.request(b"GET", path, headers=headers)
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (reply := Sends(1, client, h2_ended(sid)))  # our SETTINGS, then the answer
    pb.done()
    (head,) = [e for e in reply.events if isinstance(e, h2.events.ResponseReceived)]
    fields = dict(head.headers)
    return int(fields[b":status"]), fields, h2_body(reply.events, sid)


MANY = [(f"x-{i}", "1") for i in range(5)]


@pytest.mark.parametrize(("path", "shaped"), [("/v1/models", True), ("/other", False)])
def test_h1_431_takes_the_routes_shape(path: str, shaped: bool) -> None:
    pb = Playbook(config(max_header_fields=3))
    status, headers, body = h1_answer(pb, H1ClientPeer().request("GET", path, MANY))
    assert status == 431
    if shaped:
        assert headers[b"content-type"] == b"application/json"
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    else:
        assert headers[b"content-type"].startswith(b"text/plain")


@pytest.mark.parametrize(("path", "shaped"), [(b"/v1/models", True), (b"/other", False)])
def test_h2_431_takes_the_routes_shape(path: bytes, shaped: bool) -> None:
    pb = Playbook(config(max_header_fields=3))
    many = [(name.encode(), value.encode()) for name, value in MANY]
    status, headers, body = h2_answer(pb, path, many)
    assert status == 431
    if shaped:
        assert headers[b"content-type"] == b"application/json"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
    else:
        assert headers[b"content-type"].startswith(b"text/plain")


def test_h1_413_on_an_openai_route() -> None:
    pb = Playbook(config(max_request_body=4))
    request = H1ClientPeer().request("POST", "/v1/chat/completions", body=b"0123456789")
    status, headers, body = h1_answer(pb, request)
    assert status == 413
    assert json.loads(body)["error"] == {
        "message": "content-length above 4 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert int(headers[b"content-length"]) == len(body)


def test_502_on_an_openai_route_and_404_plain() -> None:
    pb = Playbook(config())
    pb.accept(1)
    client = H1ClientPeer()
    pb >> data(1, client.request("GET", "/v1/models"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb >> open_failed(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (reply := Sends(1, client, h1_response(502)))
    pb << CloseConnection(conn=1)
    pb.done()
    assert json.loads(h1_body(reply.events))["error"]["message"] == "upstream unavailable"

    # No route at all: not bound to a route's API.
    pb = Playbook(
        default_config(routes=(Route(prefix="/v1/", upstream="default", api=Api.OPENAI),))
    )
    request = H1ClientPeer().request("GET", "/elsewhere")
    status, headers, _ = h1_answer(pb, request, head_read=True)
    assert status == 404 and headers[b"content-type"].startswith(b"text/plain")
