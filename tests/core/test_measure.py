"""Measurements (``muxproxy.core.observe.measure``) and their merge
(``muxproxy.core.observe.series``): whole SSE exchanges through ``ProxyCore`` with h11 peers, read
by ``core.measurements.snapshot()``. The SSE meter alone is tested in ``test_ssemeter.py``.

Each exchange is a conversation (every command in order, timers included), so a measurement is
read off an exchange whose every step was asserted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs
import h11
import pytest
from checks import Check, h1_body, h1_request, h1_response
from playbook import (
    ANY,
    CHAT,
    Capture,
    H1BackendPeer,
    H1ClientPeer,
    Playbook,
    Sends,
    Where,
    closed,
    data,
    default_config,
    open_failed,
    opened,
    sent,
    subset,
)
from test_h2guard import ORIGIN

from muxproxy.config import NextUpstream, Route, Server, Upstream
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    Origin,
    SetTimer,
)
from muxproxy.core.events import RuntimeChanged
from muxproxy.core.observe.series import DURATION_BUCKETS, HEAD_BUCKETS, merge

ROLE_ONLY = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
)
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
DONE = b"data: [DONE]"


def events(*bodies: bytes) -> bytes:
    """The events of ``bodies``, each followed by its empty line."""
    return b"".join(body + b"\n\n" for body in bodies)


# -- the conversation's steps (client connection ``conn``, exchange ``ex``, backend ``up``) ----


def relayed(chunk: bytes, *, end: bool = False) -> Check:
    """A run of the response body: exactly ``chunk`` (and then its end, with ``end``)."""

    def check(events: Sequence[Any]) -> None:
        assert h1_body(events) == chunk, events
        assert not any(isinstance(e, h11.Response) for e in events), events
        assert isinstance(events[-1], h11.EndOfMessage) is end, events

    return check


def start(
    pb: Playbook,
    client: H1ClientPeer,
    *,
    conn: int = 1,
    ex: int = 1,
    up: int = -1,
    origin: Any = ORIGIN,
    written: bool = True,
) -> tuple[int, H1BackendPeer]:
    """Client connection ``conn`` (accepted here) POSTs ``{}`` to the chat path; backend
    connection ``up`` (to ``origin``) opens and gets it (``written``: all of it reported sent)."""
    pb.accept(conn)
    pb >> data(conn, client.request("POST", CHAT.decode(), body=b"{}"))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("connect", ex), at=pb.now + 5.0)
    pb << OpenConnection(conn=up, origin=origin)
    pb << SetTimer(timer=("body", ex), at=pb.now + 30.0)
    backend = H1BackendPeer()
    pb >> opened(up)
    pb << CancelTimer(timer=("connect", ex))
    pb << (request := Sends(up, backend, h1_request(b"POST", CHAT, b"{}")))
    pb << SetTimer(timer=("head", ex), at=pb.now + 60.0)
    if written:
        pb >> sent(up, len(request.data))
    return up, backend


def sse_head(
    pb: Playbook,
    client: H1ClientPeer,
    backend: H1BackendPeer,
    *,
    conn: int = 1,
    ex: int = 1,
    up: int = -1,
    then: bytes = b"",
) -> None:
    """The backend's SSE head (and the events ``then`` in the same read), relayed."""
    pb >> data(up, backend.sse_head() + (backend.chunk(then) if then else b""))
    pb << CancelTimer(timer=("head", ex))
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << Sends(conn, client, h1_response(200, b"", end=False))
    pb << SetTimer(timer=("read", ex), at=pb.now + 300.0)
    if then:
        pb << Sends(conn, client, relayed(then))


def chunk(
    pb: Playbook,
    client: H1ClientPeer,
    backend: H1BackendPeer,
    body: bytes,
    *,
    conn: int = 1,
    up: int = -1,
) -> None:
    """A chunk of events from backend connection ``up``, relayed as it is."""
    pb >> data(up, backend.chunk(body))
    pb << Sends(conn, client, relayed(body))


def finished(
    pb: Playbook,
    client: H1ClientPeer,
    backend: H1BackendPeer,
    last: bytes = b"",
    *,
    conn: int = 1,
    ex: int = 1,
    up: int = -1,
) -> None:
    """The backend's last chunk (``last``, if any) and the end of its response, relayed; the
    backend connection is pooled, the client's goes idle."""
    pb >> data(up, (backend.chunk(last) if last else b"") + backend.end())
    pb << Sends(conn, client, relayed(last, end=True))
    pb << SetTimer(timer=("pool", up), at=pb.now + 60.0)
    pb << CancelTimer(timer=("read", ex))
    pb << CancelTimer(timer=("body", ex))
    pb << SetTimer(timer=("idle", conn), at=pb.now + 75.0)


def snapshot(pb: Playbook) -> dict[str, Any]:
    data = pb.core.measurements.snapshot()
    json.dumps(data)  # JSON-able
    return {name: metric for name, metric in data["metrics"].items()}


def value(snap: dict[str, Any], name: str, *labels: str) -> Any:
    for sample in snap[name]["samples"]:
        if tuple(sample[0]) == labels:
            return sample[1]
    return None


def test_an_sse_exchange_is_measured_and_logged() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    _, backend = start(pb, client)
    pb.now = 0.05
    sse_head(pb, client, backend)
    pb.now = 0.06
    chunk(pb, client, backend, events(ROLE_ONLY))
    pb.now = 0.2
    chunk(pb, client, backend, events(TOKEN))
    live = snapshot(pb)
    assert value(live, "muxproxy_sse_events_total", "default") == 2  # a running stream's
    assert value(live, "muxproxy_active_streams", "default", "127.0.0.1:9001") == 1
    pb.now = 0.22
    chunk(pb, client, backend, events(TOKEN, FINISH, DONE))
    pb.now = 0.3
    finished(pb, client, backend)
    pb.done()

    snap = snapshot(pb)
    assert (
        value(
            snap, "muxproxy_requests_total", "default", "127.0.0.1:9001", "200", "1.1", "complete"
        )
        == 1
    )
    assert value(snap, "muxproxy_sse_events_total", "default") == 5
    assert value(snap, "muxproxy_streams_without_token_total", "default") == 0
    assert value(snap, "muxproxy_bytes_received_total", "default") == 2
    head_counts = value(snap, "muxproxy_response_head_seconds", "default")
    assert head_counts[HEAD_BUCKETS.index(0.05)] == 1
    ttft = value(snap, "muxproxy_time_to_first_token_seconds", "default", "127.0.0.1:9001")
    # 0.2 s: measured to the token, not to the role-only chunk at 0.06
    assert ttft[HEAD_BUCKETS.index(0.25)] == 1
    gaps = value(snap, "muxproxy_inter_token_seconds", "default", "127.0.0.1:9001")
    assert sum(gaps) == 1  # one read after the first token
    duration = value(snap, "muxproxy_stream_duration_seconds", "default")
    assert duration[DURATION_BUCKETS.index(0.5)] == 1
    assert value(snap, "muxproxy_active_streams", "default", "127.0.0.1:9001") == 0
    assert value(snap, "muxproxy_server_up", "default", "127.0.0.1:9001") == 1
    assert value(snap, "muxproxy_server_weight", "default", "127.0.0.1:9001") == 1

    (access,) = [c for c in pb.log if isinstance(c, Log) and c.event == "access"]
    fields = access.fields
    body = events(ROLE_ONLY) + events(TOKEN) + events(TOKEN, FINISH, DONE)  # relayed as is
    assert fields["events"] == 5
    assert fields["ttfh"] == pytest.approx(0.05)
    assert fields["ttft"] == pytest.approx(0.2)
    assert fields["duration"] == pytest.approx(0.3)
    assert fields["bytes_in"] == 2
    assert fields["bytes_out"] == len(body) == value(snap, "muxproxy_bytes_sent_total", "default")
    assert fields["version"] == "1.1" and fields["upstream_version"] == "1.1"
    assert fields["group"] == "default" and fields["server"] == "127.0.0.1:9001"
    assert fields["server_id"] is not None and len(fields["server_id"]) == 16
    assert fields["outcome"] == "ok" and fields["status"] == 200 and fields["tries"] == 1
    assert fields["session"] is None


def test_a_stream_that_ends_without_a_token_is_counted() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    _, backend = start(pb, client)
    sse_head(pb, client, backend)
    chunk(pb, client, backend, events(ROLE_ONLY, FINISH, DONE))
    finished(pb, client, backend)
    pb.done()
    snap = snapshot(pb)
    assert value(snap, "muxproxy_streams_without_token_total", "default") == 1
    assert value(snap, "muxproxy_sse_events_total", "default") == 3
    assert (
        sum(value(snap, "muxproxy_time_to_first_token_seconds", "default", "127.0.0.1:9001")) == 0
    )
    (access,) = [c for c in pb.log if isinstance(c, Log) and c.event == "access"]
    assert access.fields["ttft"] is None and access.fields["events"] == 3


def test_retries_and_failures_are_counted_by_reason() -> None:
    group = Upstream(
        name="gpus",
        servers=(Server(address="127.0.0.1:9001"), Server(address="127.0.0.1:9002")),
        next_upstream=NextUpstream(tries=2),
    )
    config = default_config(upstreams={"gpus": group})
    config = attrs.evolve(config, routes=(attrs.evolve(config.routes[0], upstream="gpus"),))
    pb = Playbook(config, ignore=())
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/v1/models"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    first = Capture[Origin]("first")
    pb << OpenConnection(conn=-1, origin=first.slot)
    failed = f"{first.value.host}:{first.value.port}"
    pb >> open_failed(-1, "connection refused")
    pb << Log(event="health", fields=subset({"server": failed, "up": False}))
    pb << CancelTimer(timer=("connect", 1))
    retry = {"group": "gpus", "server": failed, "condition": "error"}
    pb << Log(event="retry", fields=subset(retry))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << Where(OpenConnection, lambda c: c.conn == -2 and c.origin != first.value)
    pb.done()
    snap = snapshot(pb)
    assert value(snap, "muxproxy_upstream_failures_total", "gpus", failed, "error") == 1
    assert value(snap, "muxproxy_retries_total", "gpus", "error") == 1
    assert value(snap, "muxproxy_server_up", "gpus", failed) == 0  # max_fails = 1: out


def test_a_request_without_a_route_is_counted_without_group_or_server() -> None:
    pb = Playbook(default_config(routes=(Route(prefix="/v1/", upstream="default"),)))
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/nothing"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(404))
    pb << CloseConnection(conn=1)
    pb.done()
    snap = snapshot(pb)
    assert value(snap, "muxproxy_requests_total", "", "", "404", "1.1", "complete") == 1


# -- merge -----------------------------------------------------------------------------------


def test_merge_sums_counters_and_histograms_and_keeps_gauge_rules() -> None:
    a = Playbook()
    b = Playbook()
    for pb in (a, b):
        client = H1ClientPeer()
        _, backend = start(pb, client)
        pb.now = 0.01
        sse_head(pb, client, backend)
        chunk(pb, client, backend, events(TOKEN, DONE))
        finished(pb, client, backend)
    state = RuntimeState.empty().changed("default", "127.0.0.1:9001", weight=5)
    b >> RuntimeChanged(now=b.now, state=state)
    a.done()
    b.done()
    merged = merge([a.core.measurements.snapshot(), b.core.measurements.snapshot()])
    metrics = merged["metrics"]
    assert value(metrics, "muxproxy_sse_events_total", "default") == 4
    assert (
        value(
            metrics,
            "muxproxy_requests_total",
            "default",
            "127.0.0.1:9001",
            "200",
            "1.1",
            "complete",
        )
        == 2
    )
    assert (
        value(metrics, "muxproxy_response_head_seconds", "default")[HEAD_BUCKETS.index(0.01)] == 2
    )
    assert value(metrics, "muxproxy_server_weight", "default", "127.0.0.1:9001") == 5  # max
    assert value(metrics, "muxproxy_client_connections") == 2  # summed
    json.dumps(merged)


def test_merge_refuses_snapshots_that_disagree() -> None:
    snap = Playbook().core.measurements.snapshot()
    other = json.loads(json.dumps(snap))
    other["metrics"]["muxproxy_inter_token_seconds"]["buckets"] = [1.0]
    with pytest.raises(ValueError, match="muxproxy_inter_token_seconds: buckets"):
        merge([snap, other])
    with pytest.raises(ValueError, match="format"):
        merge([{"format": 99, "metrics": {}}])


def test_a_server_set_down_by_the_operator_is_not_up() -> None:
    pb = Playbook()
    state = RuntimeState.empty().changed("default", "127.0.0.1:9001", down=True)
    pb >> RuntimeChanged(now=pb.now, state=state)
    pb.done()
    snap = snapshot(pb)
    assert value(snap, "muxproxy_server_up", "default", "127.0.0.1:9001") == 0


def test_token_times_are_per_server_and_a_stream_cut_mid_way_is_counted_cut() -> None:
    # A gray release is judged by the new server's time to first token against the others'
    # (docs/operations.md); a 200 whose stream broke is not a success.
    group = Upstream(
        name="gpus",
        servers=(Server(address="127.0.0.1:9001"), Server(address="127.0.0.1:9002")),
    )
    config = default_config(upstreams={"gpus": group})
    pb = Playbook(attrs.evolve(config, routes=(attrs.evolve(config.routes[0], upstream="gpus"),)))
    client1, client2 = H1ClientPeer(), H1ClientPeer()
    first, backend1 = start(pb, client1, origin=ANY)
    pb.now = 0.01
    sse_head(pb, client1, backend1)
    chunk(pb, client1, backend1, events(TOKEN))
    up, backend = start(pb, client2, conn=2, ex=2, up=-2, origin=ANY, written=False)
    pb.now = 0.5
    sse_head(pb, client2, backend, conn=2, ex=2, up=-2, then=events(TOKEN))
    finished(pb, client1, backend1, events(DONE))
    pb >> closed(up)  # the second backend dies mid-stream
    pb << CancelTimer(timer=("read", 2))
    pb << CancelTimer(timer=("body", 2))
    pb << CloseConnection(conn=2)  # the client sees the chunked body cut short
    pb.done()
    snap = snapshot(pb)
    servers = {c.conn: f"{c.origin.host}:{c.origin.port}" for c in pb.opens()}
    fast, slow = servers[first], servers[up]
    assert fast != slow
    ttft = "muxproxy_time_to_first_token_seconds"
    assert value(snap, ttft, "gpus", fast)[HEAD_BUCKETS.index(0.01)] == 1
    assert value(snap, ttft, "gpus", slow)[HEAD_BUCKETS.index(0.5)] == 1
    assert sum(value(snap, "muxproxy_inter_token_seconds", "gpus", fast)) == 1
    requests = "muxproxy_requests_total"
    assert value(snap, requests, "gpus", fast, "200", "1.1", "complete") == 1
    assert value(snap, requests, "gpus", slow, "200", "1.1", "cut") == 1
    assert value(snap, requests, "gpus", slow, "200", "1.1", "complete") is None
