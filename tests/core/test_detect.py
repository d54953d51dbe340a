"""``core/client/detect.py``: which protocol a client connection speaks (RFC 9113 §3.3, §3.4).

The first bytes are fed whole and byte by byte: a proper start of the preface is never decided
early, anything else is decided at its first byte that departs from the preface.
"""

from __future__ import annotations

import base64

import h2.settings
import pytest
from playbook import default_config

from muxproxy.core.client.detect import PREFACE_LINE, by_alpn, h2c_server, sniff
from muxproxy.core.client.downstream_states import Protocol
from muxproxy.core.effects import Effects
from muxproxy.core.http1.h2c import H2cUpgrade
from muxproxy.core.http2.h2 import PREFACE
from muxproxy.core.messages import RequestHead

REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: proxy.example\r\n\r\n"


def test_every_proper_start_of_the_preface_waits_for_more() -> None:
    for end in range(len(PREFACE)):
        assert sniff(PREFACE[:end]) is None, end


def test_the_preface_and_what_follows_it_is_http2() -> None:
    assert sniff(PREFACE) is Protocol.HTTP2
    assert sniff(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00") is Protocol.HTTP2


def test_the_preface_line_with_a_broken_rest_is_http2_for_h2_to_refuse() -> None:
    """RFC 9113 §3.4: ``PRI * HTTP/2.0`` is no HTTP/1.1 request line; h2 answers the rest."""
    broken = PREFACE_LINE + b"\r\n\r\nXX\r\n\r\n"
    assert len(broken) == len(PREFACE)
    assert sniff(broken) is Protocol.HTTP2


@pytest.mark.parametrize("first", [REQUEST, b"G", b"PUT / HTTP/1.1\r\n", b"PRI / HTTP/1.1\r\n"])
def test_anything_else_is_http1_from_its_first_departing_byte(first: bytes) -> None:
    assert sniff(first) is Protocol.HTTP1
    departs = next(i for i, byte in enumerate(first) if i >= len(PREFACE) or PREFACE[i] != byte)
    for end in range(1, departs + 1):
        assert sniff(first[:end]) is None, end
    assert sniff(first[: departs + 1]) is Protocol.HTTP1


def test_alpn_chooses_http2_only_when_it_says_h2() -> None:
    assert by_alpn("h2") is Protocol.HTTP2
    assert by_alpn("http/1.1") is Protocol.HTTP1
    assert by_alpn(None) is Protocol.HTTP1


def offer(settings: dict[int, int]) -> H2cUpgrade:
    payload = b"".join(
        code.to_bytes(2, "big") + v.to_bytes(4, "big") for code, v in settings.items()
    )
    head = RequestHead(
        stream=1,
        method=b"GET",
        target=b"/",
        authority=b"proxy.example",
        scheme=b"http",
        headers=[],
        end_stream=True,
    )
    return H2cUpgrade(head=head, settings=base64.urlsafe_b64encode(payload))


def test_an_h2c_offer_with_settings_h2_takes_gets_an_http2_side() -> None:
    fx = Effects(default_config())
    codes = h2.settings.SettingCodes
    assert h2c_server(fx, b"http", offer({codes.MAX_CONCURRENT_STREAMS: 10})) is not None


def test_an_h2c_offer_with_settings_out_of_range_is_served_over_http1() -> None:
    """RFC 9113 §6.5.2: SETTINGS_ENABLE_PUSH is 0 or 1."""
    fx = Effects(default_config())
    assert h2c_server(fx, b"http", offer({h2.settings.SettingCodes.ENABLE_PUSH: 2})) is None
