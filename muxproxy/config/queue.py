"""The record of a group's ``queue`` table: where requests wait while every server is full.

A leaf module (no import from the rest of :mod:`muxproxy.config`), so :mod:`.records` can
name :class:`AdmissionQueue` in :class:`~muxproxy.config.records.Upstream`; the checks are in
:mod:`.upstreams`, the queue itself in :mod:`muxproxy.routing.admission`, a request's wait in
:mod:`muxproxy.core.exchange.admit`.

A request's priority class (the group's ``priority`` source) is an integer 0..9, lower
served first; each class may have a deadline of its own (``max_wait``), so a batch job
queued at class 9 gives up long before an interactive request at class 0 does.
"""

from __future__ import annotations

import attrs

__all__ = ["PRIORITIES", "AdmissionQueue"]

PRIORITIES = 10
"""Priority classes 0..9 (lower first): vLLM's ``priority`` orders its own queue so, and ten
classes are more than any deployment names (interactive, batch, background...)."""


@attrs.frozen(kw_only=True)
class AdmissionQueue:
    """``queue``: where requests wait while every candidate server is full (``max_streams``,
    ``max_waiting``)."""

    max: int = 1000
    """Requests waiting at most (per group and process); past it: 429."""
    timeout: float = 30.0
    """Seconds a request may wait; then: 429. The deadline of every priority class that
    ``max_wait`` does not name."""
    max_wait: tuple[tuple[int, float], ...] = ()
    """Seconds a request of a priority class may wait, per class: ``{ 0 = 60, 9 = "2s" }``
    (seconds, or a duration such as ``"500ms"`` or ``"2m"``; classes 0..9, as ``priority``
    reads them). A class not named waits ``timeout``. Past its deadline a request is
    answered 429 (``queue_timeout``), whatever waits in other classes."""
    retry_after: int = 1
    """The ``Retry-After`` seconds of a 429 for a full queue or a wait that timed out."""
    affinity_wait: float = 0.1
    """Locality in the queue: a keyed request (a session key or a prefix) whose server is
    full while another has room waits this many seconds for a slot on its own server before
    it takes the other; and a freed slot goes to the first of the next waiting requests that
    belongs on its server (its session key's or prefix's first candidate), or that has
    waited this many seconds; if none does, to the first in fair order that does not wait for
    its own server alone (no slot stays idle longer). 0.1 s: about what an engine takes to
    compute a few thousand tokens of prompt cold, so a longer wait for a cached prefix saves
    less than it costs, and slots of a busy engine free several times a second. 0: no wait,
    fair order alone."""

    def wait_for(self, priority: int) -> float:
        """The seconds a request of class ``priority`` may wait (``max_wait``, else
        ``timeout``)."""
        for level, seconds in self.max_wait:
            if level == priority:
                return seconds
        return self.timeout
