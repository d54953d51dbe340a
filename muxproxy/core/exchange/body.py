"""The request body as an exchange holds it: bytes not yet sent, and bytes kept for a replay.

A request may be tried on several backends (``next_upstream``), so its body is kept until the
response is committed to the client — but only up to ``replay_limit`` bytes: a longer body is
streamed without a copy and the request is not retried (RFC 9110 §9.2.2 leaves retrying to us;
keeping unbounded copies is not an option). The part not yet sent to the current backend is
what counts for backpressure; the replay copy has its own bound.
"""

from __future__ import annotations


class RequestBody:
    def __init__(self, replay_limit: int) -> None:
        self.replay_limit = replay_limit
        self.chunks: list[bytes] = []
        """Unsent chunks, preceded by the sent ones while the body is replayable."""
        self.sent = 0
        """How many of ``chunks`` the current backend already has."""
        self.size = 0
        """Bytes received in all."""
        self.unsent_size = 0
        self.replayable = True

    def add(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        self.unsent_size += len(data)
        if self.replayable and self.size > self.replay_limit:
            self.replayable = False
            del self.chunks[: self.sent]
            self.sent = 0

    def held(self, replay_limit: int) -> None:
        """The body was held whole, nothing sent, before its group was known (its model is
        read first, ``bymodel.py``): from now on it is kept for replays up to the group's
        ``replay_limit``, as if it had been from the start."""
        self.replay_limit = replay_limit
        self.replayable = self.size <= replay_limit

    def replace(self, data: bytes) -> None:
        """The bytes held, none of them sent yet, become ``data`` (a rewritten body)."""
        assert self.sent == 0 and self.unsent_size == self.size
        self.chunks = [data]
        self.size = self.unsent_size = len(data)

    def take_unsent(self) -> list[bytes]:
        """The chunks the current backend has not had yet; they count as sent from now on."""
        unsent = self.chunks[self.sent :]
        if self.replayable:
            self.sent = len(self.chunks)
        else:
            self.chunks.clear()
            self.sent = 0
        self.unsent_size = 0
        return unsent

    def rewind(self) -> bool:
        """Make every chunk unsent again, for a retry; False if the body was not kept."""
        if not self.replayable:
            return False
        self.sent = 0
        self.unsent_size = self.size
        return True

    def prefix(self) -> bytes:
        """What was received so far (for a session key in the body), while all of it is held.

        That is while replayable, and also while nothing was sent yet: a body held to find
        its session key is all in ``chunks`` even when it is larger than ``replay_limit``
        (``replay_buffer = 0`` turns replays off; it must not turn body keys off too).
        """
        if self.replayable or self.unsent_size == self.size:
            return b"".join(self.chunks)
        return b""

    def commit(self) -> None:
        """The response went to the client: no retry can happen, drop the replay copy."""
        if self.replayable:
            del self.chunks[: self.sent]
            self.sent = 0
            self.replayable = False
