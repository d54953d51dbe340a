"""The control channel between the supervisor and one worker (:mod:`muxproxy.process.workers`).

One ``AF_UNIX`` ``SOCK_STREAM`` socketpair per worker; both ends speak the same framing:

* A message is one JSON object on one line, UTF-8, ending in ``\\n`` (JSON text never holds a
  raw newline, RFC 8259 §7, so the newline is an unambiguous frame end).
* A message that carries file descriptors (listening sockets handed over on a reload) names
  their count in its ``"fds"`` field and is sent with them attached (``SCM_RIGHTS``,
  unix(7)). Linux delivers the descriptors with the first byte of that send, so they have
  arrived by the time its line is complete; the receiver queues descriptors in arrival order
  and gives each message the number it names. A receive whose control buffer was too small
  for them (``MSG_CTRUNC``: the kernel has closed the excess) is a broken channel.
* End of file is the peer gone: a worker that exited, or a supervisor that died.

Both peers are muxproxy processes of the same installation, so a malformed line is a bug and
raises :class:`ChannelError`; it never comes from a network peer.
"""

from __future__ import annotations

import array
import json
import os
import socket
from collections import deque
from collections.abc import Sequence
from typing import Any

import trio

MAX_FDS = 250
"""Descriptors one message may carry: the kernel's ``SCM_MAX_FD`` is 253."""
RECEIVE_SIZE = 65536
"""Bytes asked of each ``recvmsg``; a status or metrics snapshot may span several."""

Message = dict[str, Any]


class ChannelError(Exception):
    """The peer sent something that is not a message of this protocol (a bug, not an input)."""


class Channel:
    """JSON-lines messages, with file descriptors, over one end of a Unix socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.socket = trio.socket.from_stdlib_socket(sock)
        self._buffer = bytearray()
        self._fds: deque[int] = deque()
        self._send_lock = trio.Lock()
        self._eof = False

    async def send(self, message: Message, fds: Sequence[int] = ()) -> None:
        """Send ``message``, with ``fds`` attached (their count goes in ``"fds"``).

        Raises ``trio.BrokenResourceError`` when the peer has gone.
        """
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(fds)} descriptors in one message; at most {MAX_FDS}")
        if fds:
            message = {**message, "fds": len(fds)}
        data = memoryview(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        # One sender at a time: two messages' bytes must not interleave.
        async with self._send_lock:
            try:
                if fds:
                    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    data = data[await self.socket.sendmsg([data], rights) :]
                while data:
                    data = data[await self.socket.send(data) :]
            except OSError as exc:  # EPIPE, ECONNRESET: the peer exited
                raise trio.BrokenResourceError(f"control channel closed: {exc}") from exc

    async def receive(self) -> tuple[Message, list[int]] | None:
        """The next message and the descriptors it carries; None at end of file.

        The caller owns the descriptors (close or adopt them). Raises :class:`ChannelError`
        for a line that is not a JSON object or names descriptors that did not come.
        """
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return self._decode(line)
            if self._eof:
                if self._buffer:
                    raise ChannelError(f"control channel ended inside a message: {self._buffer!r}")
                return None
            await self._receive_some()

    def _decode(self, line: bytes) -> tuple[Message, list[int]]:
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise ChannelError(f"control message is not JSON: {line[:200]!r}") from exc
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise ChannelError(f"control message without a type: {line[:200]!r}")
        count = message.get("fds", 0)
        if not isinstance(count, int) or not 0 <= count <= len(self._fds):
            raise ChannelError(
                f"control message names {count!r} descriptors; {len(self._fds)} came"
            )
        return message, [self._fds.popleft() for _ in range(count)]

    async def _receive_some(self) -> None:
        try:
            data, ancillary, flags, _ = await self.socket.recvmsg(
                RECEIVE_SIZE, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
            )
        except OSError:  # ECONNRESET: as good as end of file
            data, ancillary, flags = b"", [], 0
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise ChannelError("descriptors were lost: the control buffer was too small")
        if not data:
            self._eof = True
        self._buffer += data

    def close(self) -> None:
        """Close the socket and any descriptors received that no message claimed."""
        while self._fds:
            os.close(self._fds.popleft())
        self.socket.close()


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """A Unix socketpair: the supervisor's end (close-on-exec) and the worker's end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ours, theirs
