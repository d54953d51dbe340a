"""End to end: a configuration that ``muxproxy check`` accepts is one ``serve`` can run.

The largest value the loader admits for each limit sent as an HTTP/2 SETTINGS value (RFC 9113
§6.5.2: 32 bits) still makes a valid first frame: an HTTP/2 client is served over a real
socket, and an HTTP/1.1 client after it (a value past 32 bits used to end every HTTP/2
connection in its first frame).
"""

from __future__ import annotations

from pathlib import Path

import h2.settings
import trio
from peers import h1_read_response, h1_request_bytes, open_h2, open_tcp

from muxproxy.config import load_config
from muxproxy.config.ranges import RANGES

STREAMS = int(RANGES["limits.max_concurrent_streams"].high)
HEAD = int(RANGES["limits.max_request_head"].high)
WINDOW = int(RANGES["limits.h2_connection_window"].high)


async def test_largest_http2_settings_the_loader_accepts_serve_both_protocols(
    start_backend, start_proxy, tmp_path: Path
):
    _, backend = await start_backend(backend_id="gpu0")
    path = tmp_path / "top.toml"
    path.write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n'
        f"[limits]\nmax_concurrent_streams = {STREAMS}\nmax_request_head = {HEAD}\n"
        f"h2_connection_window = {WINDOW}\n"
        f'[upstreams.gpus]\nservers = ["127.0.0.1:{backend}"]\n'
    )
    proxy = await start_proxy(config=load_config(path))
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            advertised = peer.conn.remote_settings
            assert advertised[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == STREAMS
            assert advertised[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE] == HEAD
            sid = await peer.request("GET", "/v1/models")
            stream = await peer.wait_done(sid)
            assert stream.status == 200 and peer.terminated is None
        tcp = await open_tcp(proxy.port)
        async with tcp:
            conn, request = h1_request_bytes()
            await tcp.send_all(request)
            response, body = await h1_read_response(tcp, conn)
    assert response.status_code == 200 and b"fake-llm" in body
