"""Limits from ``[limits]`` as the core applies them: past each, a status or a reset, and
nothing forwarded (RFC 6585 §5 431, RFC 9110 §15.5.14 413, RFC 9113 §5.1.2 stream limits)."""

from __future__ import annotations

import attrs
import h2.errors
import h2.events
import pytest
from checks import h1_response, h2_resets, h2_response
from playbook import ANY, H1ClientPeer, H2ClientPeer, Playbook, Sends, data, default_config

from muxproxy.config import ConfigError, Limits, parse_config
from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, SetTimer


def playbook(**limits: int) -> Playbook:
    return Playbook(default_config(limits=Limits(**limits)))


def h2_open(pb: Playbook) -> H2ClientPeer:
    """Client connection 1 (TLS, ALPN h2) past the prefaces, before the conversation."""
    pb.accept(1, tls=True, alpn="h2")
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    client.events(pb.take(1))
    return client


def h2_post_head(client: H2ClientPeer, extra: list[tuple[bytes, bytes]] | None = None) -> int:
    sid = client.conn.get_next_available_stream_id()
    head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    client.conn.send_headers(sid, head + (extra or []))
    return sid


def test_too_many_h1_fields_is_431_and_not_forwarded():
    pb = playbook(max_header_fields=8)
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request(headers=[(f"x-{i}", "1") for i in range(8)]))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(431))
    pb << CloseConnection(conn=1)
    pb.done()  # no OpenConnection: nothing forwarded


def test_fields_up_to_the_limit_are_forwarded():
    pb = playbook(max_header_fields=8)
    pb.accept(1)
    pb >> data(1, H1ClientPeer().request(headers=[(f"x-{i}", "1") for i in range(7)]))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb.done()


def test_too_large_h1_head_is_431():
    pb = playbook(max_request_head=1024)
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request(headers=[("x-big", "a" * 2000)]))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(431))
    pb << CloseConnection(conn=1)
    pb.done()


def test_too_many_h2_fields_is_431_on_its_stream_only():
    pb = playbook(max_header_fields=8)
    client = h2_open(pb)
    sid, request = client.request(headers=[(f"x-{i}".encode(), b"1") for i in range(9)])
    pb >> data(1, request)
    pb << Sends(1, client, h2_response(sid, 431, ended=True))
    pb.done()  # nothing forwarded, and the connection stays open


def test_content_length_above_max_request_body_is_413_before_forwarding():
    pb = playbook(max_request_body=100)
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("POST", body=b"x" * 101))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(413))
    pb << CloseConnection(conn=1)
    pb.done()


def test_h2_content_length_above_max_request_body_is_413_and_cancels_the_upload():
    pb = playbook(max_request_body=100)
    client = h2_open(pb)
    sid = h2_post_head(client, [(b"content-length", b"1000")])
    pb >> data(1, client.conn.data_to_send())
    pb << Sends(1, client, h2_response(sid, 413, reset=h2.errors.ErrorCodes.NO_ERROR))
    pb.done()  # nothing forwarded


def test_chunked_body_growing_past_the_limit_is_413_and_closes():
    pb = playbook(max_request_body=100)
    client = H1ClientPeer()
    client.request()  # the client peer only decodes; the request goes as raw chunks
    pb.accept(1)
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    pb >> data(1, head + b"50\r\n" + b"x" * 80 + b"\r\n")
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb >> data(1, b"50\r\n" + b"x" * 80 + b"\r\n")
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(413))
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << CloseConnection(conn=1)
    pb.done()


def test_h2_body_growing_past_the_limit_is_413_while_no_response_began():
    pb = playbook(max_request_body=100)
    client = h2_open(pb)
    sid = h2_post_head(client)
    client.conn.send_data(sid, b"x" * 80)
    pb >> data(1, client.conn.data_to_send())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb << SetTimer(timer=("body", 1), at=30.0)
    client.conn.send_data(sid, b"x" * 80)
    pb >> data(1, client.conn.data_to_send())
    pb << CloseConnection(conn=-1)  # the attempt is abandoned, the client's connection kept
    pb << CancelTimer(timer=("connect", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << Sends(1, client, h2_response(sid, 413))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


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
        sid, request = client.request()
        sids.append(sid)
        wire += request
    client.events(pb.take(1))  # our SETTINGS, sent on accept
    pb >> data(1, wire)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ANY)
    pb << Sends(1, client, h2_resets((sids[2], h2.errors.ErrorCodes.REFUSED_STREAM)))
    pb.done()


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
