"""Limits from ``[limits]`` as the core applies them: past each, a status or a reset, and
nothing forwarded (RFC 6585 §5 431, RFC 9110 §15.5.14 413, RFC 9113 §5.1.2 stream limits)."""

from __future__ import annotations

import attrs
import h2.errors
import h2.events
import pytest
from playbook import H1ClientPeer, H2ClientPeer, Playbook, default_config

from muxproxy.config import ConfigError, Limits, parse_config
from muxproxy.core.commands import CloseConnection


def playbook(**limits: int) -> Playbook:
    return Playbook(default_config(limits=Limits(**limits)))


def h1_status(pb: Playbook) -> int:
    client = H1ClientPeer()
    client.request()
    return int(client.events(pb.take(1))[0].status_code)


def h2_open(pb: Playbook) -> H2ClientPeer:
    pb.accept(1, tls=True, alpn="h2")
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    client.events(pb.take(1))
    return client


def h2_response(client: H2ClientPeer, pb: Playbook, sid: int) -> list[h2.events.Event]:
    return [e for e in client.events(pb.take(1)) if getattr(e, "stream_id", None) == sid]


def test_too_many_h1_fields_is_431_and_not_forwarded():
    pb = playbook(max_header_fields=8)
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request(headers=[(f"x-{i}", "1") for i in range(8)]))
    assert pb.opens() == []
    assert h1_status(pb) == 431
    assert any(isinstance(c, CloseConnection) for c in pb.log)


def test_fields_up_to_the_limit_are_forwarded():
    pb = playbook(max_header_fields=8)
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request(headers=[(f"x-{i}", "1") for i in range(7)]))
    assert len(pb.opens()) == 1


def test_too_large_h1_head_is_431():
    pb = playbook(max_request_head=1024)
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request(headers=[("x-big", "a" * 2000)]))
    assert pb.opens() == []
    assert h1_status(pb) == 431


def test_too_many_h2_fields_is_431_on_its_stream_only():
    pb = playbook(max_header_fields=8)
    client = h2_open(pb)
    sid, data = client.request(headers=[(f"x-{i}".encode(), b"1") for i in range(9)])
    pb.receive(1, data)
    assert pb.opens() == []
    events = h2_response(client, pb, sid)
    (head,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(head.headers)[b":status"] == b"431"
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)
    assert not any(isinstance(c, CloseConnection) for c in pb.log)


def test_content_length_above_max_request_body_is_413_before_forwarding():
    pb = playbook(max_request_body=100)
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request("POST", body=b"x" * 101))
    assert pb.opens() == []
    assert h1_status(pb) == 413


def test_h2_content_length_above_max_request_body_is_413_and_cancels_the_upload():
    pb = playbook(max_request_body=100)
    client = h2_open(pb)
    sid = client.conn.get_next_available_stream_id()
    client.conn.send_headers(
        sid,
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":authority", b"a"),
            (b":path", b"/"),
            (b"content-length", b"1000"),
        ],
    )
    pb.receive(1, client.conn.data_to_send())
    assert pb.opens() == []
    events = h2_response(client, pb, sid)
    (head,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(head.headers)[b":status"] == b"413"
    (reset,) = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert reset.error_code == h2.errors.ErrorCodes.NO_ERROR


def test_chunked_body_growing_past_the_limit_is_413_and_closes():
    pb = playbook(max_request_body=100)
    pb.accept(1)
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    pb.receive(1, head + b"50\r\n" + b"x" * 80 + b"\r\n")
    assert len(pb.opens()) == 1
    pb.receive(1, b"50\r\n" + b"x" * 80 + b"\r\n")
    assert h1_status(pb) == 413
    assert any(isinstance(c, CloseConnection) and c.conn == 1 for c in pb.log)


def test_h2_body_growing_past_the_limit_is_413_while_no_response_began():
    pb = playbook(max_request_body=100)
    client = h2_open(pb)
    sid = client.conn.get_next_available_stream_id()
    client.conn.send_headers(
        sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    )
    client.conn.send_data(sid, b"x" * 80)
    pb.receive(1, client.conn.data_to_send())
    assert len(pb.opens()) == 1
    client.conn.send_data(sid, b"x" * 80)
    pb.receive(1, client.conn.data_to_send())
    events = h2_response(client, pb, sid)
    (head,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(head.headers)[b":status"] == b"413"
    assert not any(isinstance(c, CloseConnection) and c.conn == 1 for c in pb.log)


def test_h2_connection_window_is_the_configured_one():
    pb = playbook(h2_connection_window=1024 * 1024)
    client = h2_open(pb)
    assert client.conn.outbound_flow_control_window == 1024 * 1024


def test_stream_past_max_concurrent_streams_is_refused_alone():
    pb = playbook(max_concurrent_streams=2)
    pb.accept(1, tls=True, alpn="h2")
    client = H2ClientPeer()
    # Three requests sent before the client has seen our SETTINGS (as a hurried client or an
    # attacker does): the third is past the limit we advertise.
    wire = client.preface()
    sids = []
    for _ in range(3):
        sid, data = client.request()
        sids.append(sid)
        wire += data
    pb.receive(1, wire)
    events = client.events(pb.take(1))
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events)
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(e.stream_id, e.error_code) for e in resets] == [
        (sids[2], h2.errors.ErrorCodes.REFUSED_STREAM)
    ]


BASE = {"listeners": [{"address": "127.0.0.1:0"}], "upstreams": {"g": {"servers": ["a:1"]}}}


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"h2_connection_window": 1000}, "limits.h2_connection_window: expected 65535 to"),
        ({"h2_connection_window": 2**31}, "limits.h2_connection_window: expected 65535 to"),
        ({"stream_buffer": 100}, "limits.stream_buffer: expected 2048 to"),
        ({"max_request_body": 0}, "limits.max_request_body: expected a positive integer"),
        ({"max_header_fields": "x"}, "limits.max_header_fields: expected a positive integer"),
        ({"max_client_connections": -1}, "limits.max_client_connections: expected a positive"),
    ],
)
def test_invalid_limits_are_named_by_key(limits, message):
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "limits": limits})
    assert any(p.startswith(message) for p in info.value.problems), info.value.problems


def test_limits_load_from_toml_with_defaults_for_the_rest():
    config = parse_config({**BASE, "limits": {"max_request_body": 1024, "max_header_fields": 50}})
    assert config.limits == attrs.evolve(Limits(), max_request_body=1024, max_header_fields=50)
