"""``core/http2/h2preface.py``: the client preface is the 24 octets followed by a SETTINGS frame
(RFC 9113 §3.4), on the shared plain port (prior knowledge), the TLS port and after an h2c
upgrade; anything else is GOAWAY(PROTOCOL_ERROR) and the close. h2spec's 3.5/1 and 3.5/2 as
bytes. Fed whole and byte by byte."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import h11
import hyperframe.frame
import pytest
from playbook import H1ClientPeer, Playbook

from muxproxy.core.commands import CloseConnection
from muxproxy.core.http2.h2 import PREFACE
from muxproxy.core.http2.h2preface import SettingsFirstBuffer

PROTOCOL_ERROR = h2.errors.ErrorCodes.PROTOCOL_ERROR
SETTINGS = hyperframe.frame.SettingsFrame(0, settings={0x4: 65535}).serialize()
NOT_SETTINGS = {
    "ping": hyperframe.frame.PingFrame(0, opaque_data=b"12345678").serialize(),
    "window-update": hyperframe.frame.WindowUpdateFrame(0, window_increment=1).serialize(),
    "headers": hyperframe.frame.HeadersFrame(1, data=b"\x82", flags=["END_HEADERS"]).serialize(),
    "unknown-type": b"\x00\x00\x00\xff\x00\x00\x00\x00\x00",
}


def server_events(data: bytes) -> list[h2.events.Event]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    return client.receive_data(data)


def answered(pb: Playbook, conn: int) -> tuple[list[h2.events.Event], bool]:
    closed = any(isinstance(c, CloseConnection) and c.conn == conn for c in pb.log)
    return server_events(pb.take(conn)), closed


def goaway_codes(events: list[h2.events.Event]) -> list[int]:
    return [e.error_code for e in events if isinstance(e, h2.events.ConnectionTerminated)]


@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("first", sorted(NOT_SETTINGS))
def test_a_preface_followed_by_another_frame_than_settings_is_goaway(
    first: str, tls: bool, split: int
) -> None:
    pb = Playbook(split=split)
    pb.accept(1, tls=tls, alpn="h2" if tls else None)
    pb.receive(1, PREFACE + NOT_SETTINGS[first])
    events, closed = answered(pb, 1)
    assert goaway_codes(events) == [PROTOCOL_ERROR]
    assert closed and pb.opens() == []


@pytest.mark.parametrize("split", [0, 1])
def test_h2spec_3_5_1_the_preface_and_settings_get_our_settings(split: int) -> None:
    """h2spec 3.5/1: the exact preface and a SETTINGS frame: our SETTINGS (and its ACK)."""
    pb = Playbook(split=split)
    pb.accept(1)
    pb.receive(1, PREFACE + SETTINGS)
    events, closed = answered(pb, 1)
    assert isinstance(events[0], h2.events.RemoteSettingsChanged)
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events)
    assert goaway_codes(events) == [] and not closed


def test_h2spec_3_5_2_an_invalid_preface_closes_the_connection() -> None:
    """h2spec 3.5/2 sends ``INVALID CONNECTION PREFACE\\r\\n\\r\\n`` and wants the connection
    closed. On the shared port it is no HTTP/2 (not ``PRI * HTTP/2.0``): an HTTP/1.1 400
    and the close."""
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, b"INVALID CONNECTION PREFACE\r\n\r\n")
    client = H1ClientPeer()
    client.request()
    (response, *_) = client.events(pb.take(1))
    assert isinstance(response, h11.Response) and response.status_code == 400
    assert any(isinstance(c, CloseConnection) and c.conn == 1 for c in pb.log)


@pytest.mark.parametrize(
    "data",
    [b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + SETTINGS, b"PRI * HTTP/2.0\r\n\r\n" + b"\0" * 9],
    ids=["wrong-magic", "no-magic"],
)
def test_an_http2_like_start_that_is_not_the_preface_is_goaway(data: bytes) -> None:
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, data)
    events, closed = answered(pb, 1)
    assert goaway_codes(events) == [PROTOCOL_ERROR] and closed


def test_the_check_is_passed_once_and_then_every_frame_is_h2s() -> None:
    buffer = SettingsFirstBuffer()
    buffer.max_frame_size = 16384
    for byte in PREFACE + SETTINGS:
        buffer.add_data(bytes([byte]))
    buffer.add_data(NOT_SETTINGS["ping"])  # a PING after the SETTINGS is fine
    assert [type(f).__name__ for f in buffer] == ["SettingsFrame", "PingFrame"]
