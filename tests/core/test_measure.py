"""Measurements (``muxproxy.core.observe.measure``) and their merge
(``muxproxy.core.observe.series``): whole SSE exchanges through ``ProxyCore`` with h11 peers, read
by ``core.measurements.snapshot()``. The SSE meter alone is tested in ``test_ssemeter.py``.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import h11
import pytest
from playbook import H1BackendPeer, H1ClientPeer, Playbook, default_config

from muxproxy.config import NextUpstream, Route, Server, Upstream
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import Log
from muxproxy.core.events import OpenFailed, RuntimeChanged
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


# -- through the core ------------------------------------------------------------------------


def start(pb: Playbook, client: H1ClientPeer, **request: Any) -> tuple[int, H1BackendPeer]:
    pb.accept(1)
    pb.receive(1, client.request("POST", "/v1/chat/completions", body=b"{}", **request))
    up = pb.opens()[-1].conn
    pb.opened(up)
    pb.sent(up, len(pb.take(up)))
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    return up, backend


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
    up, backend = start(pb, client)
    pb.now = 0.05
    pb.receive(up, backend.sse_head())
    pb.now = 0.06
    pb.receive(up, backend.chunk(events(ROLE_ONLY)))
    pb.now = 0.2
    pb.receive(up, backend.chunk(events(TOKEN)))
    live = snapshot(pb)
    assert value(live, "muxproxy_sse_events_total", "default") == 2  # a running stream's
    assert value(live, "muxproxy_active_streams", "default", "127.0.0.1:9001") == 1
    pb.now = 0.22
    pb.receive(up, backend.chunk(events(TOKEN, FINISH, DONE)))
    pb.now = 0.3
    pb.receive(up, backend.end())

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
    body = b"".join(e.data for e in client.events(pb.take(1)) if isinstance(e, h11.Data))
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
    up, backend = start(pb, client)
    pb.receive(up, backend.sse_head())
    pb.receive(up, backend.chunk(events(ROLE_ONLY, FINISH, DONE)))
    pb.receive(up, backend.end())
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
    pb = Playbook(config)
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("GET", "/v1/models"))
    first = pb.opens()[-1]
    pb.feed(OpenFailed(now=pb.now, conn=first.conn, reason="connection refused"))
    snap = snapshot(pb)
    failed = f"{first.origin.host}:{first.origin.port}"
    assert value(snap, "muxproxy_upstream_failures_total", "gpus", failed, "error") == 1
    assert value(snap, "muxproxy_retries_total", "gpus", "error") == 1
    assert value(snap, "muxproxy_server_up", "gpus", failed) == 0  # max_fails = 1: out
    (retry,) = [c for c in pb.log if isinstance(c, Log) and c.event == "retry"]
    assert retry.fields["group"] == "gpus" and retry.fields["server"] == failed
    assert retry.fields["condition"] == "error"
    (health,) = [c for c in pb.log if isinstance(c, Log) and c.event == "health"]
    assert health.fields["server"] == failed and health.fields["up"] is False


def test_a_request_without_a_route_is_counted_without_group_or_server() -> None:
    pb = Playbook(default_config(routes=(Route(prefix="/v1/", upstream="default"),)))
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request("GET", "/nothing"))
    snap = snapshot(pb)
    assert value(snap, "muxproxy_requests_total", "", "", "404", "1.1", "complete") == 1


# -- merge -----------------------------------------------------------------------------------


def test_merge_sums_counters_and_histograms_and_keeps_gauge_rules() -> None:
    a = Playbook()
    b = Playbook()
    for pb in (a, b):
        client = H1ClientPeer()
        up, backend = start(pb, client)
        pb.now = 0.01
        pb.receive(up, backend.sse_head())
        pb.receive(up, backend.chunk(events(TOKEN, DONE)))
        pb.receive(up, backend.end())
    state = RuntimeState.empty().changed("default", "127.0.0.1:9001", weight=5)
    b.feed(RuntimeChanged(now=b.now, state=state))
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
    pb.feed(RuntimeChanged(now=pb.now, state=state))
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
    first = start(pb, H1ClientPeer())
    pb.now = 0.01
    pb.receive(first[0], first[1].sse_head())
    pb.receive(first[0], first[1].chunk(events(TOKEN)))
    pb.accept(2)
    pb.receive(2, H1ClientPeer().request("POST", "/v1/chat/completions", body=b"{}"))
    up = pb.opens()[-1].conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    pb.now = 0.5
    pb.receive(up, backend.sse_head() + backend.chunk(events(TOKEN)))
    pb.receive(first[0], first[1].chunk(events(DONE)) + first[1].end())
    pb.closed(up)  # the second backend dies mid-stream
    snap = snapshot(pb)
    servers = {c.conn: f"{c.origin.host}:{c.origin.port}" for c in pb.opens()}
    fast, slow = servers[first[0]], servers[up]
    assert fast != slow
    ttft = "muxproxy_time_to_first_token_seconds"
    assert value(snap, ttft, "gpus", fast)[HEAD_BUCKETS.index(0.01)] == 1
    assert value(snap, ttft, "gpus", slow)[HEAD_BUCKETS.index(0.5)] == 1
    assert sum(value(snap, "muxproxy_inter_token_seconds", "gpus", fast)) == 1
    requests = "muxproxy_requests_total"
    assert value(snap, requests, "gpus", fast, "200", "1.1", "complete") == 1
    assert value(snap, requests, "gpus", slow, "200", "1.1", "cut") == 1
    assert value(snap, requests, "gpus", slow, "200", "1.1", "complete") is None
