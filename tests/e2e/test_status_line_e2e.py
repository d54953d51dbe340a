"""End to end through ``python -m muxproxy serve``: the status lines a client reads carry a
reason phrase (RFC 9112 §4; h2load counts ``HTTP/1.1 200 `` as a failure).

A raw backend answers with an empty phrase, with its own words for a known code, with a code
that has no standard phrase, or not at all (the proxy's own 502); the client reads the raw
status line of each.
"""

from __future__ import annotations

import signal
from pathlib import Path

import trio
from peers import open_tcp, serve_raw
from processes import proxy_process

ANSWERS = {
    b"/empty": b"HTTP/1.1 200 \r\nContent-Length: 2\r\n\r\nok",
    b"/own-words": b"HTTP/1.1 404 Nothing Here\r\nContent-Length: 2\r\n\r\nno",
    b"/unknown": b"HTTP/1.1 299 Custom Thing\r\nContent-Length: 2\r\n\r\nok",
}


async def backend(stream: trio.SocketStream) -> None:
    """Answers one request per connection by its path; closes without an answer for others."""
    async with stream:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(65536)
            if not data:
                return
            head += data
        answer = ANSWERS.get(head.split(b" ", 2)[1])
        if answer is not None:
            await stream.send_all(answer)


async def status_line(port: int, path: bytes) -> bytes:
    stream = await open_tcp(port)
    async with stream:
        await stream.send_all(b"GET %s HTTP/1.1\r\nHost: proxy.test\r\n\r\n" % path)
        received = b""
        while b"\r\n" not in received:
            data = await stream.receive_some(65536)
            assert data, received
            received += data
        return received.split(b"\r\n", 1)[0]


async def test_status_lines_carry_the_standard_reason_phrase(tmp_path: Path) -> None:
    path = tmp_path / "muxproxy.toml"
    async with trio.open_nursery() as nursery:
        port = await serve_raw(nursery, backend)
        path.write_text(
            '[[listeners]]\naddress = "127.0.0.1:0"\n'
            f'[upstreams.gpus]\nservers = ["127.0.0.1:{port}"]\n'
        )
        async with proxy_process(nursery, config=path, stop=signal.SIGTERM) as proxy:
            proxy_port = proxy.ports()[0]
            with trio.fail_after(20):
                lines = [
                    await status_line(proxy_port, target)
                    for target in (b"/empty", b"/own-words", b"/unknown", b"/no-answer")
                ]
        nursery.cancel_scope.cancel()
    assert lines == [
        b"HTTP/1.1 200 OK",
        b"HTTP/1.1 404 Not Found",
        b"HTTP/1.1 299 Custom Thing",
        b"HTTP/1.1 502 Bad Gateway",  # the proxy's own
    ]
