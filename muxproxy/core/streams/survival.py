"""What a stream keeps to outlive its client (resume) or its backend (continuation, and a
held SSE response's retry before its first content event).

One record per exchange, made only on a route that needs it, so that an exchange keeps few
enough attributes for CPython's shared-key instance dicts (they are on the per-token path),
and an exchange whose ``survival`` is None pays nothing per chunk for it.
"""

from __future__ import annotations

import attrs

from muxproxy.core.messages import ResponseHead
from muxproxy.core.streams.commit import CommitPoint
from muxproxy.core.streams.continuation import FollowedAnswer
from muxproxy.core.streams.resume import Resumable
from muxproxy.core.streams.sseids import EventStamper


@attrs.define(eq=False)
class Survival:
    """What a stream keeps to outlive its client (resume) or its backend (continuation)."""

    backend_head: ResponseHead | None = None
    """The backend's response head, as it came (a resumed client's head is made from it)."""
    resumable: Resumable | None = None
    """The kept events of a resumable SSE response (``resume.py``)."""
    stamper: EventStamper | None = None
    """Numbers the events of a resumable response (``sseids.py``)."""
    answer: FollowedAnswer | None = None
    """The chat answer relayed so far, on a ``continue_on_failure`` route
    (``continuation.py``)."""
    continuations: int = 0
    held: CommitPoint | None = None
    """While an SSE head is held (``retry_until_first_event``): the attempt's bytes before
    its first content event (``commit.py``)."""

    def committed(self) -> Survival | None:
        """The response is committed to: nothing is held any more. None when nothing else
        is kept either (the per-chunk path then skips the record)."""
        self.held = None
        kept = (self.backend_head, self.resumable, self.stamper, self.answer)
        if self.continuations or any(value is not None for value in kept):
            return self
        return None
