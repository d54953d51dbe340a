"""A probe that reads its answer's body: the shared half of ``LoadPoll`` (an engine's metrics
page, ``loadpoll.py``) and ``ModelPoll`` (its model list, ``modelpoll.py``).

It obeys the probe's way to the server and its states (``probes.py``) and adds a bounded
read: the body of a 200 is kept up to ``body_limit`` bytes (past it nothing more is kept and
the poll fails), then handed whole to the subclass's ``_read``, which says what was wrong
with it, or nothing. A status other than 200, a body too large or one ``_read`` refuses ends
the poll as failed with the reason (``_done``): backend bytes never raise here.
"""

from __future__ import annotations

from muxproxy.config import Upstream
from muxproxy.core.effects import Effects
from muxproxy.core.messages import ResponseHead
from muxproxy.core.ports import ProbeHost
from muxproxy.core.upstream.probes import Probe


class BodyPoll(Probe):
    WHAT = "answer"
    """What the body is, in the reasons of a failure (``"report"``, ``"model list"``)."""

    def __init__(
        self,
        fx: Effects,
        host: ProbeHost,
        group: Upstream,
        index: int,
        ident: int,
        *,
        body_limit: int,
    ) -> None:
        super().__init__(fx, host, group, index, ident)
        self.body_limit = body_limit
        self.body = bytearray()
        self.too_large = False
        self.failing: bool | None = None
        """The last poll failed (its failure was logged; the next success is too); None:
        no poll ended yet."""

    def response_head(self, head: ResponseHead) -> None:
        self.status = head.status
        self.body = bytearray()
        self.too_large = False

    def response_body(self, data: bytes) -> None:
        if self.too_large:
            return
        if len(self.body) + len(data) > self.body_limit:
            self.too_large = True
            self.body = bytearray()
            return
        self.body += data

    def _ended(self) -> None:
        if self.status != 200:
            self._done(False, f"status {self.status}")
            return
        if self.too_large:
            self._done(False, f"{self.WHAT} larger than {self.body_limit} bytes")
            return
        body, self.body = bytes(self.body), bytearray()
        problem = self._read(body)
        if problem is not None:
            self._done(False, f"unreadable {self.WHAT}: {problem}")
            return
        self._done(True, "ok")

    def _read(self, body: bytes) -> str | None:
        """Take the whole body; what is wrong with it, or None."""
        raise NotImplementedError
