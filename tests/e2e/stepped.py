"""A peer the test steps by hand, for end-to-end tests: a raw HTTP/1.1 backend that records
everything it receives (the h2c client stepped by hand is ``tests/h2client.py``).

``RecordingBackend`` answers each request head with ``answer`` (or never, with None) and keeps
the bytes, so a test can check what the proxy forwarded, byte for byte.
"""

from __future__ import annotations

import re

import attrs
import trio

__all__ = ["OK", "RecordingBackend"]

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@attrs.define
class RecordingBackend:
    """Answers every request head (no body expected) with ``answer``, or never (None);
    records all it got."""

    answer: bytes | None = OK
    connections: int = 0
    received: bytearray = attrs.field(factory=bytearray)
    arrived: trio.Event = attrs.field(factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = bytearray()
        async with stream:
            try:
                while data := await stream.receive_some(65536):
                    self.received += data
                    self.arrived.set()
                    self.arrived = trio.Event()
                    if self.answer is None:
                        continue
                    buffer += data
                    while b"\r\n\r\n" in buffer:
                        del buffer[: buffer.index(b"\r\n\r\n") + 4]
                        await stream.send_all(self.answer)
            except trio.BrokenResourceError:
                pass

    @property
    def heads(self) -> int:
        return bytes(self.received).count(b"\r\n\r\n")

    @property
    def targets(self) -> list[bytes]:
        return re.findall(rb"(?:^|\r\n\r\n)[A-Z]+ (\S+) HTTP/1\.1\r\n", bytes(self.received))

    async def wait_for(self, target: bytes) -> None:
        while target not in self.targets:
            await self.arrived.wait()
