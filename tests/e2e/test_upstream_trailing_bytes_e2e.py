"""End to end through ``python -m muxproxy serve``: bytes an HTTP/1.1 backend sends after a
complete response never reach another client.

A raw backend answers each request with a Content-Length body and then a whole response of its
own (``POISON``): in the same write, or later, while the connection waits idle in the proxy's
pool. Two clients, one after the other, on their own connections: the second gets its own
answer over a new backend connection, never ``POISON``, and the proxy logs
``upstream_trailing_bytes`` (RFC 9112 §9.3).
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
from peers import h1_read_response, h1_request_bytes, open_tcp, serve_raw
from processes import ProxyProcess, proxy_process

POISON = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nPOISON"


async def read_head(stream: trio.abc.Stream, buffer: bytearray) -> bool:
    """Whether a whole request head (a GET, no body) arrived before EOF; it is consumed."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return False
        buffer += data
    del buffer[: buffer.index(b"\r\n\r\n") + 4]
    return True


@attrs.define
class PoisoningBackend:
    """Answers ``answer-N`` on its N-th connection, then appends ``POISON``: in the same write,
    or (``later``) once ``poison`` is set."""

    later: bool
    connections: int = 0
    poison: trio.Event = attrs.Factory(trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        body = b"answer-%d" % self.connections
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        buffer = bytearray()
        async with stream:
            while await read_head(stream, buffer):
                if self.later:
                    await stream.send_all(answer)
                    await self.poison.wait()
                    await stream.send_all(POISON)
                else:
                    await stream.send_all(answer + POISON)


@asynccontextmanager
async def serving(
    tmp_path: Path, backend: PoisoningBackend
) -> AsyncIterator[tuple[ProxyProcess, int]]:
    """``muxproxy serve`` in front of ``backend``: the process and the backend's port."""
    async with trio.open_nursery() as nursery:
        port = await serve_raw(nursery, backend.handle)
        path = tmp_path / "muxproxy.toml"
        path.write_text(
            '[[listeners]]\naddress = "127.0.0.1:0"\n'
            f'[upstreams.gpus]\nservers = ["127.0.0.1:{port}"]\n'
        )
        async with proxy_process(nursery, config=path, stop=signal.SIGTERM) as proxy:
            yield proxy, port
        nursery.cancel_scope.cancel()


async def get(port: int) -> tuple[int, bytes]:
    """One client on a connection of its own: GET /v1/models, the status and body."""
    stream = await open_tcp(port)
    async with stream:
        conn, request = h1_request_bytes()
        await stream.send_all(request)
        response, body = await h1_read_response(stream, conn)
        return response.status_code, body


@pytest.mark.parametrize("later", [False, True], ids=["same_write", "while_pooled"])
async def test_a_backends_bytes_after_its_response_never_reach_the_next_client(
    tmp_path: Path, later: bool
) -> None:
    backend = PoisoningBackend(later=later)
    async with serving(tmp_path, backend) as (proxy, backend_port):
        port = proxy.ports()[0]
        with trio.fail_after(20):
            assert await get(port) == (200, b"answer-1")
            if later:
                # Until the bytes arrive the pooled connection is a clean one: the next
                # client comes once the proxy read them.
                backend.poison.set()
                await proxy.wait_log("upstream_trailing_bytes")
            status, body = await get(port)
            assert b"POISON" not in body
            assert (status, body) == (200, b"answer-2")
            line = await proxy.wait_log("upstream_trailing_bytes")
    assert backend.connections == 2
    assert f"server=127.0.0.1:{backend_port}" in line
