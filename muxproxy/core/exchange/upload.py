"""The request direction of an exchange: its body, from the client to the current backend stream.

What it obeys:

- Bounded buffers (``flow.py``): request bytes taken from the client and not yet written to
  the backend (held here while there is no backend stream, then the stream's ``pending``)
  are counted; at ``high_water`` the client is stopped (HTTP/1.1: PauseReading; HTTP/2: its
  WINDOW_UPDATEs are withheld, RFC 9113 §6.9), at ``low_water`` it resumes. HTTP/2 credit is
  given back as the bytes move on, and all of it when the exchange ends.
- Replays: the body is kept up to ``replay_buffer`` bytes (``body.py``), and each new backend
  stream gets what it has not had (all of it after a rewind for a retry).
- The request is complete with its head or with its End; the trailers go on as either
  protocol can carry them (RFC 9110 §6.5.1).
- Slow bodies: a body must keep moving (``timeouts.client_header`` between bytes) and be
  complete within ``timeouts.client_body`` of the head (``bodyclock.py``); time in which we
  stopped the client counts for neither.
- Its phase (``ports.RequestPhase``) is its own. The response side's phases are the
  exchange's (``exchange_states.py``), which calls in here only for an input it took.
"""

from __future__ import annotations

from muxproxy.core.effects import Effects
from muxproxy.core.exchange.body import RequestBody
from muxproxy.core.exchange.deadlines import Deadlines
from muxproxy.core.flow import Flow
from muxproxy.core.http.bodyclock import BodyClock, SlowBody
from muxproxy.core.http.headers import trailer_fields
from muxproxy.core.messages import Headers
from muxproxy.core.ports import RequestPhase, RequestSource, UpstreamStream
from muxproxy.core.timers import ExchangeTimer


class Upload:
    """The request body of one exchange (client stream ``stream``)."""

    def __init__(
        self, fx: Effects, client: RequestSource, stream: int, deadlines: Deadlines, complete: bool
    ) -> None:
        self.fx = fx
        self.client = client
        self.stream = stream
        self.deadlines = deadlines
        self.phase = RequestPhase.COMPLETE if complete else RequestPhase.BODY
        self.body = RequestBody(0)
        self.flow = Flow()
        """The client as the body's source; its credit: HTTP/2 bytes not yet acknowledged."""
        self.trailers: Headers = []
        self.clock = BodyClock(fx.now)
        """The whole-body deadline (``timeouts.client_body``)."""
        self.model: str | None = None
        """The model the body names, where it is read before routing (``bymodel.py``)."""
        self.served_model: str | None = None
        """The model the body was rewritten to (an alias's target), else None."""

    @property
    def sending(self) -> bool:
        """The client still owes body bytes and we do not stop it (``Deadlines.backend_late``)."""
        return self.phase is RequestPhase.BODY and not self.flow.stopped

    def watch(self) -> None:
        """Slow request bodies (slowloris on HTTP/2, a stalled upload on HTTP/1.1, also one
        buffered for a session key, a body trickled just under the gap): a request with a
        body must keep it moving and finish it in time. The ``body`` timer is lazy: armed once
        here, moved only when it fires (``stalled``), so a body chunk costs no timer command."""
        fx = self.fx
        timeouts = fx.config.timeouts
        due = min(fx.now + timeouts.client_header, self.clock.due(fx.now, timeouts.client_body))
        self.deadlines.arm(ExchangeTimer.BODY, due)

    def stalled(self) -> SlowBody | None:
        """The ``body`` timer fired: which bound the body broke, if the client still owes
        body bytes (``bodyclock.py``); else None, and the timer is armed again."""
        if self.phase is not RequestPhase.BODY:
            return None
        fx, deadlines = self.fx, self.deadlines
        now, timeouts = fx.now, fx.config.timeouts
        if self.flow.stopped:  # we stop it: its idle time starts when it may send again
            deadlines.request_at = now
        whole = self.clock.due(now, timeouts.client_body)
        if now >= whole:
            return SlowBody.TOO_SLOW
        gap = deadlines.request_at + timeouts.client_header
        if now >= gap:
            return SlowBody.IDLE
        deadlines.arm(ExchangeTimer.BODY, min(gap, whole))
        return None

    def take(self, data: bytes, flow_len: int, upstream: UpstreamStream | None) -> None:
        """Body bytes (``flow_len`` of HTTP/2 credit): to ``upstream``, or held."""
        self.flow.hold(flow_len)
        self.deadlines.request_at = self.fx.now
        self.body.add(data)
        if upstream is not None:
            for chunk in self.body.take_unsent():
                upstream.send_body(chunk)

    def end(self, trailers: Headers, upstream: UpstreamStream | None) -> bool:
        """The client's End; False if the request was complete already (with its head)."""
        if self.phase is RequestPhase.COMPLETE:
            return False
        self.phase = RequestPhase.COMPLETE
        self.deadlines.request_done_at = self.fx.now
        trailers = self.trailers = trailer_fields(trailers) if trailers else trailers
        if upstream is not None:
            upstream.send_end(trailers)
        return True

    def send(self, upstream: UpstreamStream) -> None:
        """A new backend stream: the body it has not had, and the end if it came."""
        for chunk in self.body.take_unsent():
            upstream.send_body(chunk)
        if self.phase is RequestPhase.COMPLETE:
            upstream.send_end(self.trailers)

    def buffered(self, upstream: UpstreamStream | None) -> int:
        """Bytes taken from the client and not yet written to the backend."""
        return self.body.unsent_size + (upstream.pending if upstream is not None else 0)

    def check(self, buffered: int) -> None:
        """The request now holds ``buffered`` bytes (``Exchange.request_buffered``): stop or
        resume the client, and give back the credit of what moved on."""
        flow = self.flow
        client = self.client
        limits = self.fx.limits
        if flow.filled(buffered, limits):
            self.clock.stopped(self.fx.now)
            client.pause_source()
        elif flow.drained(buffered, limits):
            # The client could not send while we withheld its window: its idle time starts
            # now (the ``body`` timer), and its deadline moves by the time it was stopped.
            now = self.deadlines.request_at = self.fx.now
            self.clock.going(now)
            client.resume_source()
        credit = flow.release()
        if credit:
            client.acknowledge(self.stream, credit)

    def give_back(self, flow_len: int) -> None:
        """Body bytes the exchange did not take: their credit goes back now (HTTP/2; an
        HTTP/1.1 body has none)."""
        if flow_len:
            self.client.acknowledge(self.stream, flow_len)

    def settle(self) -> None:
        """The exchange ended: all the credit back, and the client read again."""
        flow = self.flow
        credit = flow.take()
        if credit:
            self.client.acknowledge(self.stream, credit)
        if flow.resume():
            self.client.resume_source()
