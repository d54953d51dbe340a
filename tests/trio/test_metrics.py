"""``muxproxy.trio.metrics.render``: snapshots of real cores, parsed back by prometheus_client."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "core"))

from playbook import H1BackendPeer, H1ClientPeer, Playbook

from muxproxy.core.observe.series import HEAD_BUCKETS
from muxproxy.trio.metrics import render

TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'


def served(head_after: float) -> Playbook:
    """A core that relayed one SSE response (head after ``head_after`` s, two events)."""
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("GET", "/v1/x"))
    up = pb.opens()[-1].conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    pb.now = head_after
    pb.receive(up, backend.sse_head())
    pb.receive(up, backend.chunk(TOKEN + b"data: [DONE]\n\n"))
    pb.receive(up, backend.end())
    return pb


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def types(text: bytes) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text.decode())}


def test_render_merges_two_workers_by_summing() -> None:
    a = served(0.004).core.measurements.snapshot()
    b = served(0.2).core.measurements.snapshot()
    text = render([a, b])
    got = samples(text)
    group = (("group", "default"),)
    server = (("group", "default"), ("server", "127.0.0.1:9001"))
    request = (
        ("group", "default"),
        ("outcome", "complete"),
        ("protocol", "1.1"),
        ("server", "127.0.0.1:9001"),
        ("status", "200"),
    )
    assert got[("muxproxy_requests_total", request)] == 2
    # Per server: a new release on one server shows in its own series.
    assert got[("muxproxy_time_to_first_token_seconds_count", server)] == 2
    assert got[("muxproxy_sse_events_total", group)] == 4
    assert got[("muxproxy_streams_without_token_total", group)] == 0
    head = "muxproxy_response_head_seconds"
    assert got[(head + "_count", group)] == 2
    assert got[(head + "_sum", group)] == pytest.approx(0.204)
    # Cumulative buckets: one head in 5 ms, the other in 0.25 s.
    assert got[(head + "_bucket", (*group, ("le", "0.005")))] == 1
    assert got[(head + "_bucket", (*group, ("le", "0.25")))] == 2
    assert got[(head + "_bucket", (*group, ("le", "+Inf")))] == 2
    assert len([k for k in got if k[0] == head + "_bucket"]) == len(HEAD_BUCKETS) + 1
    assert got[("muxproxy_server_up", server)] == 1
    assert got[("muxproxy_active_streams", server)] == 0
    assert got[("muxproxy_client_connections", ())] == 2
    kinds = types(text)
    assert kinds["muxproxy_requests"] == "counter"
    assert kinds["muxproxy_time_to_first_token_seconds"] == "histogram"
    assert kinds["muxproxy_server_weight"] == "gauge"


def test_every_metric_has_help_and_a_type() -> None:
    text = render([served(0.01).core.measurements.snapshot()])
    assert b"# HELP muxproxy_inter_token_seconds " in text
    assert b"# TYPE muxproxy_requests_total counter" in text


def test_render_refuses_snapshots_that_disagree() -> None:
    good = served(0.01).core.measurements.snapshot()
    bad: dict[str, Any] = {"format": 1, "metrics": {**good["metrics"]}}
    bad["metrics"]["muxproxy_server_up"] = {
        **good["metrics"]["muxproxy_server_up"],
        "type": "counter",
    }
    with pytest.raises(ValueError, match="muxproxy_server_up: type differs"):
        render([good, bad])
