"""``core/http2/h2preface.py``: the client preface is the 24 octets followed by a SETTINGS frame
(RFC 9113 §3.4), on the shared plain port (prior knowledge), the TLS port and after an h2c
upgrade; anything else is GOAWAY(PROTOCOL_ERROR) and the close. h2spec's 3.5/1 and 3.5/2 as
bytes. Fed whole and byte by byte; every command is asserted in order, timers included."""

from __future__ import annotations

from collections.abc import Sequence

import h2.config
import h2.connection
import h2.errors
import h2.events
import hyperframe.frame
import pytest
from checks import h1_response
from playbook import H1ClientPeer, Playbook, Sends, accepted, data

from muxproxy.core.commands import CloseConnection, SetTimer
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


class Server:
    """What an h2 client decodes of the proxy's bytes (a decoder for ``Sends``)."""

    def __init__(self) -> None:
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.client.initiate_connection()

    def events(self, data: bytes) -> list[h2.events.Event]:
        return self.client.receive_data(data)


def goaway_codes(events: Sequence[h2.events.Event]) -> list[int]:
    return [e.error_code for e in events if isinstance(e, h2.events.ConnectionTerminated)]


def protocol_error(events: Sequence[h2.events.Event]) -> None:
    """One GOAWAY(PROTOCOL_ERROR)."""
    assert goaway_codes(events) == [PROTOCOL_ERROR], events


def refused(pb: Playbook, data_: bytes, server: Server, *, armed: bool = False) -> None:
    """``data_`` on client connection 1: GOAWAY(PROTOCOL_ERROR) and the close, no backend;
    ``armed``: the send timer is armed already (the proxy spoke first)."""
    pb >> data(1, data_)
    if not armed:
        pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, server, protocol_error)
    pb << CloseConnection(conn=1)
    pb.done()  # no OpenConnection


@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("first", sorted(NOT_SETTINGS))
def test_a_preface_followed_by_another_frame_than_settings_is_goaway(
    first: str, tls: bool, split: int
) -> None:
    pb = Playbook(split=split)
    server = Server()
    if tls:
        # ALPN chose h2: the proxy sends its SETTINGS at once.
        pb >> accepted(1, tls=True, alpn="h2")
        pb << SetTimer(timer=("send", 1), at=60.0)
        pb << Sends(1, server, lambda events: not goaway_codes(events))
        pb << SetTimer(timer=("header", 1), at=30.0)
    else:
        pb.accept(1)
    refused(pb, PREFACE + NOT_SETTINGS[first], server, armed=tls)


@pytest.mark.parametrize("split", [0, 1])
def test_h2spec_3_5_1_the_preface_and_settings_get_our_settings(split: int) -> None:
    """h2spec 3.5/1: the exact preface and a SETTINGS frame: our SETTINGS (and its ACK)."""
    pb = Playbook(split=split)
    pb.accept(1)
    pb >> data(1, PREFACE + SETTINGS)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (answer := Sends(1, Server()))
    pb.done()  # no GOAWAY, no close
    events = answer.events
    assert isinstance(events[0], h2.events.RemoteSettingsChanged)
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events)
    assert goaway_codes(events) == []


def test_h2spec_3_5_2_an_invalid_preface_closes_the_connection() -> None:
    """h2spec 3.5/2 sends ``INVALID CONNECTION PREFACE\\r\\n\\r\\n`` and wants the connection
    closed. On the shared port it is no HTTP/2 (not ``PRI * HTTP/2.0``): an HTTP/1.1 400
    and the close."""
    pb = Playbook()
    pb.accept(1)
    client = H1ClientPeer()
    client.request()
    pb >> data(1, b"INVALID CONNECTION PREFACE\r\n\r\n")
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(400))
    pb << CloseConnection(conn=1)
    pb.done()


@pytest.mark.parametrize(
    "data_",
    [b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + SETTINGS, b"PRI * HTTP/2.0\r\n\r\n" + b"\0" * 9],
    ids=["wrong-magic", "no-magic"],
)
def test_an_http2_like_start_that_is_not_the_preface_is_goaway(data_: bytes) -> None:
    pb = Playbook()
    pb.accept(1)
    refused(pb, data_, Server())


def test_the_check_is_passed_once_and_then_every_frame_is_h2s() -> None:
    buffer = SettingsFirstBuffer()
    buffer.max_frame_size = 16384
    for byte in PREFACE + SETTINGS:
        buffer.add_data(bytes([byte]))
    buffer.add_data(NOT_SETTINGS["ping"])  # a PING after the SETTINGS is fine
    assert [type(f).__name__ for f in buffer] == ["SettingsFrame", "PingFrame"]
