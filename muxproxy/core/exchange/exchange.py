"""One proxied request/response: from the client's request head to the end of the response.

The exchange relays version-neutral messages between a client stream (``Downstream``) and one
backend stream (``pool.UpstreamStream``: a whole HTTP/1.1 connection or one stream of a shared
HTTP/2 connection); it never sees bytes of either protocol. Its rules:

- Phases as data: ``phase`` changes through ``move`` alone, as ``exchange_states.py`` says.
  Each entry point asks it whether its event is taken in the current phase (a late event is
  ignored; one only a bug can bring raises ``IllegalTransition``), and each decision (route,
  retry, hold, commit, fail, finish) is a move the table must allow.
- Its parts, which see it through ``exchangeports.py``: where it goes (route, budgets, queue,
  servers, retries: RFC 9110 §9.2.2) is ``placement.py``'s; what outlives its client or its
  backend (resume, continuation) ``surviving.py``'s; a held SSE head ``commit.py``'s; its
  hooks ``hooked.py``'s; its body's model ``bymodel.py``'s. A backend chunk goes out at once.
- Bounded buffers (``flow.py``): the backend is stopped while the client side holds ``high_water``
  bytes of this stream or its connection is behind, resumed at ``low_water``; the body likewise.
- Cancellation propagates: a client that goes away closes the backend at once (a GPU stops
  generating tokens nobody reads). Truncation is visible: a backend failing after the response
  head makes the client side abort the stream (HTTP/2 RST_STREAM; HTTP/1.1 no final chunk).
- Errors before the head map to answers of our own (``heads.py``): no route 404, no usable backend
  503, refused or broken backend 502, timeout 504 (RFC 9110 §15.6), counted in the access log like
  a backend's. Date (RFC 9110 §6.6.1): a response without one gets the proxy's (``dates.py``).
- Timeouts blame the party that is late (``deadlines.py``): the backend's never count time it waits
  for us, the client's ``body`` timer never time we withheld its window (``refuse_slow_body``).
"""

from __future__ import annotations

from typing import assert_never

from muxproxy.config import Route, Upstream
from muxproxy.core.apis.streaming import stream_for
from muxproxy.core.commands import Log
from muxproxy.core.effects import Effects
from muxproxy.core.events import BudgetAnswered
from muxproxy.core.exchange import placement, surviving
from muxproxy.core.exchange.admit import Admission, UsageScan
from muxproxy.core.exchange.deadlines import BACKEND_TIMEOUTS, Deadlines, Heartbeat
from muxproxy.core.exchange.exchange_states import TIMER_INPUTS, TRANSITIONS, ExchangeInput
from muxproxy.core.exchange.exchangeports import ExchangeHost
from muxproxy.core.exchange.failover import Failover
from muxproxy.core.exchange.heads import VIA, backend_fields, client_head, send_error_answer
from muxproxy.core.exchange.hooked import ExchangeHooks
from muxproxy.core.exchange.upload import Upload
from muxproxy.core.flow import Flow
from muxproxy.core.http import grpc
from muxproxy.core.http.bodyclock import SlowBody
from muxproxy.core.http.headers import header_value, is_event_stream, trailer_fields
from muxproxy.core.messages import Fields, Headers, OwnBody, RequestHead, ResponseHead
from muxproxy.core.observe.access import access_fields, add_to_totals, backend_ids
from muxproxy.core.observe.ssemeter import SseMeter, meter_rules
from muxproxy.core.ports import ExchangeClient, Phase, RequestClient, RequestPhase, UpstreamStream
from muxproxy.core.states import step
from muxproxy.core.streams.commit import CommitPoint
from muxproxy.core.streams.continuation import FollowedAnswer
from muxproxy.core.streams.resume import Reader, Resumable, State
from muxproxy.core.streams.sseids import EventStamper
from muxproxy.core.streams.survival import Survival
from muxproxy.core.timers import ExchangeTimer

__all__ = ["VIA", "Exchange", "Phase", "RequestPhase", "Survival"]
Own = OwnBody | None  # ``fail``'s body: an answer's own, or None for the text's
_I = ExchangeInput
_T = ExchangeTimer


class Exchange:
    def __init__(
        self, fx: Effects, host: ExchangeHost, client: RequestClient, head: RequestHead, ident: int
    ) -> None:
        self.fx = fx
        self.host = host
        self.client: ExchangeClient = client
        self.stream = head.stream
        self.head = head
        self.ident = ident
        self.phase = Phase.CONNECTING
        """Changed by ``move`` alone, as ``TRANSITIONS`` says (and by fault isolation)."""
        self.upstream: UpstreamStream | None = None
        self.route: Route | None = None
        self.group: Upstream | None = None
        self.failover: Failover | None = None
        """The servers to try and the tries made, once routed (``failover.py``)."""
        self.response: ResponseHead | None = None
        self.response_flow = Flow()
        """The backend as the response's source: stopped while the client is behind (this
        stream's bytes, or ``client_stalled``; the client side holds us: ``hold``)."""
        now = self.started = fx.now
        self.deadlines = Deadlines(
            fx=fx, ident=ident, upstream_at=now, request_at=now, request_done_at=now
        )
        self.upload = Upload(fx, client, head.stream, self.deadlines, head.end_stream)
        """The request body's way to the backend (``upload.py``)."""
        self.first_byte_at: float | None = None
        self.status = 0
        self.bytes_out = 0
        self.bytes_in = 0
        """Request body bytes taken from the client."""
        self.outcome = ""
        self.request_id = self.host.request_ids.for_request(head.headers, fx, client.peer_ip)
        """``X-Request-ID``: the client's when sane, else ours (``access.py``)."""
        self.head_at: float | None = None
        """When the backend's response head came (that of the attempt that answered)."""
        self.upstream_version: str | None = None
        self.meter: SseMeter | None = None
        """Events and first token of an SSE response (``ssemeter.py``)."""
        self.heartbeat: Heartbeat | None = None
        """The comments of an SSE response that gets them (``route.sse_heartbeat``)."""
        self.admission: Admission | None = None
        """Budgets and queue wait, in a group that has either (``admit.py``)."""
        self.usage: UsageScan | None = None
        """The response's completion tokens, for a token budget (``admit.py``)."""
        self.survival: Survival | None = None
        """On a route with ``resume`` or ``continue_on_failure``: what the stream keeps to
        outlive its client or its backend (one attribute, so that an exchange keeps few enough
        for CPython's shared-key instance dicts: its attributes are on the per-token path)."""
        self.hooks = ExchangeHooks(fx.config.extensions, self) if fx.config.extensions else None

    @property
    def resumable(self) -> Resumable | None:
        return self.survival.resumable if self.survival is not None else None

    @property
    def stamper(self) -> EventStamper | None:
        return self.survival.stamper if self.survival is not None else None

    @property
    def answer(self) -> FollowedAnswer | None:
        return self.survival.answer if self.survival is not None else None

    def move(self, input: ExchangeInput) -> bool:
        """Take ``input`` as ``TRANSITIONS`` says: False if ignored, else raises if illegal."""
        before = self.phase
        target = TRANSITIONS[(before, input)]  # taken, the common case: no call to ``step``
        after = target if type(target) is Phase else step(TRANSITIONS, "Exchange", before, input)
        self.phase = after or before  # ignored: where it was
        if self.fx.moves is not None:
            self.fx.moves.record(self, before, input, self.phase)
        return after is not None

    @property
    def request(self) -> RequestPhase:
        return self.upload.phase

    # What the access record reads (``access.Finished``) of the servers tried.
    @property
    def session_key(self) -> bytes | None:
        return self.failover.session_key if self.failover else None

    @property
    def server_address(self) -> str:
        return self.failover.address if self.failover else ""

    @property
    def server_id(self) -> str | None:
        return self.failover.server_id if self.failover else None

    @property
    def tries(self) -> int:
        return self.failover.tries if self.failover else 0

    # -- routing and admission (``placement.py``) ------------------------------------------

    def start(self) -> None:
        if placement.locate(self):
            placement.begin(self)

    def budget_answered(self, event: BudgetAnswered) -> None:
        """RESERVING: the fleet store's answer (``fleetadmit.py``): route, or refuse."""
        placement.budget_answered(self, event)

    def admitted(self) -> bool:
        """The queue admits it (``placement.admitted``); True: no room after all, it waits again."""
        return placement.admitted(self)

    # -- request direction -----------------------------------------------------------------

    def upstream_ready(self, upstream: UpstreamStream) -> None:
        """A backend connection is ours: send the head and whatever body was held."""
        if not self.move(_I.UPSTREAM_READY):
            upstream.exchange = None  # not taken: handed back
            upstream.close()
            return
        self.fx.cancel_timer((ExchangeTimer.CONNECT, self.ident))
        self._send_request(upstream)

    def _send_request(self, upstream: UpstreamStream) -> None:
        group, head, failover = self.group, self.head, self.failover
        assert group is not None and failover is not None
        self.upstream = upstream
        # An HTTP/2 request body has no framing of its own (RFC 9113 §8.1); without a
        # Content-Length the HTTP/1.1 side frames it chunked (RFC 9112 §7.1).
        fields = backend_fields(
            head, self.client, group, session_key=failover.session_key, has_body=not head.end_stream
        )
        upstream.send_head(self.stream, head.method, head.target, backend_ids(fields, self))
        self.upload.send(upstream)
        self.move(_I.REQUEST_SENT)
        self.deadlines.request_sent(group)
        self._check_request_flow()

    def request_body(self, data: bytes, flow_len: int) -> None:
        if not self.move(_I.REQUEST_BODY):
            self.upload.give_back(flow_len)  # not taken
            return
        self.bytes_in += len(data)
        self.upload.take(data, flow_len, self.upstream)
        if self.phase is Phase.BUFFERING:
            placement.route_by_body(self)
        self._check_request_flow()

    def request_end(self, trailers: Headers) -> None:
        if (
            self.move(_I.REQUEST_END)
            and self.upload.end(trailers, self.upstream)
            and self.phase is Phase.BUFFERING
        ):
            placement.route_by_body(self)

    @property
    def request_size(self) -> int:
        """Request body bytes taken from the client so far."""
        return self.upload.body.size

    def request_buffered(self) -> int:
        """Request bytes taken from the client and not yet written to the backend."""
        return self.upload.buffered(self.upstream)

    def _check_request_flow(self) -> None:
        if self.phase is not Phase.DONE:
            self.upload.check(self.request_buffered())

    def watch_request_body(self) -> None:
        """A request with a body must keep it moving (``Upload.watch``; ``websocket.py``)."""
        self.upload.watch()

    def routed_by_model(self) -> bool:  # a resume may take it now (``replay.py``)
        return False

    def upstream_drained(self) -> None:
        """The backend connection wrote some of its pending bytes."""
        if self.phase is not Phase.STREAMING and not self.move(_I.UPSTREAM_DRAINED):
            return
        flow = self.upload.flow
        if flow.stopped or flow.withheld:
            self._check_request_flow()

    def client_aborted(self, reason: str) -> None:
        """The client reset the stream or left: stop the backend (a resumable one lingers)."""
        if not self.move(_I.CLIENT_ABORTED):
            return
        if self.resumable is not None and surviving.may_linger(self):
            surviving.linger(self, reason)
            return
        self.release_upstream(close=True)
        self._finish(f"client aborted: {reason}", cut=True)

    # -- response direction ----------------------------------------------------------------

    def response_head(self, head: ResponseHead) -> None:
        if self.move(_I.RESPONSE_HEAD):
            self._relay_head(head)

    def _relay_head(self, head: ResponseHead) -> None:
        fx = self.fx
        group, route, failover = self.group, self.route, self.failover
        assert group is not None and route is not None and failover is not None
        fx.cancel_timer((ExchangeTimer.HEAD, self.ident))
        status = head.status
        condition = f"http_{status}"
        if failover.allows(condition):
            placement.retry_or_fail(self, condition, f"backend answered {status}")
            return
        failover.succeeded()
        if route.resume is not None:
            self.survive().backend_head = head
        self.status = status
        self.head_at = fx.now
        self.host.measurements.group(group.name).response_head.observe(fx.now - self.started)
        version = self.upstream.http_version if self.upstream else b"1.1"
        self.upstream_version = version.decode("ascii")
        self.response = client_head(
            head,
            stream=self.stream,
            upstream_version=version,
            to_h2=self.client.is_h2,
            date=fx.http_date(),
            request_id=self.request_id,
            pin=failover.pin(),
        )
        if self.hooks is not None and not self.hooks.response_head(self):
            return  # an extension failed, and its policy answered 502
        self.deadlines.upstream_at = fx.now
        if route.retry_until_first_event and 200 <= status < 300 and is_event_stream(head.headers):
            self.move(_I.HOLD)  # until its first content event:
            self.survive().held = CommitPoint(fx.limits.high_water, stream_for(self.head.target))
            # No head timer now, no idle one yet: else a head-only backend holds the client.
            self.deadlines.watch_reading(group)
            return
        self._commit()

    def _commit(self) -> None:
        """Send the response head: from here on nothing is retried."""
        response = self.response
        assert response is not None
        self.move(_I.COMMIT)
        if self.survival is not None:
            self.survival = self.survival.committed()
        sse = (
            200 <= self.status < 300
            and self.head.method != b"HEAD"
            and is_event_stream(response.headers)
        )
        # A sized body cannot take the ids of resume nor a continuation's spliced bytes
        # (RFC 9112 §6.3): those are for streams of unknown length, as SSE backends send.
        if sse and header_value(response.headers, b"content-length") is None:
            surviving.commit(self, response)
        self.upload.body.commit()
        self.client.send_head(response, end_stream=response.end_stream)
        self.usage = placement.usage_scan(self)  # a token budget's, or telemetry's
        deadlines = self.deadlines
        deadlines.watch_reading(self.group)
        if sse and self.group is not None:
            times = self.host.measurements.token_times(self.group.name, self.server_address)
            make = self.hooks.meter if self.hooks else SseMeter  # extensions' may tap events
            meter = self.meter = make(times, self.started, *meter_rules(self.head.target))
            if self.admission is not None:
                self.admission.streaming(meter)
            heartbeat = self.route.sse_heartbeat if self.route else None
            self.heartbeat = Heartbeat.for_response(deadlines, heartbeat, response.headers)

    # -- what outlives the client or the backend (``surviving.py``) -------------------------

    def survive(self) -> Survival:
        """The survival record, made on first need."""
        survival = self.survival
        if survival is None:
            survival = self.survival = Survival()
        return survival

    def take_reader(self, reader: Reader) -> None:
        """``resume.Owner``: ``reader`` resumed this stream (``surviving.take_reader``)."""
        surviving.take_reader(self, reader)

    def reader_left(self) -> None:
        """The resumed client went away too: linger again."""
        surviving.reader_left(self)

    def continue_with(self, upstream: UpstreamStream) -> None:
        """The stream that continues the answer is the backend from now on."""
        self.upstream = upstream

    def hand_to(self, client: ExchangeClient) -> ExchangeClient:
        """The response goes to ``client`` from now on; a backend the old one held back runs
        again (the new one holds it as it needs). Returns the old one."""
        old, upstream = self.client, self.upstream
        old.release(self)
        self.client = client
        if self.response_flow.resume() and upstream is not None:
            upstream.resume()
            self.deadlines.resumed_at = self.fx.now
        return old

    def let_go(self) -> None:
        """This exchange ends (or fault isolation drops it): ``surviving.let_go``."""
        surviving.let_go(self)

    def abandon(self, reason: str) -> None:
        """``resume.Owner``: nobody came back in time, or the window overflowed while
        nobody read: end the backend, which is what stops the GPU."""
        if self.phase is Phase.DONE:
            return
        if self.resumable is not None:
            self.host.resumes.forget(self.resumable)
        self.release_upstream(close=True)
        self._finish(reason, cut=True)

    def response_body(self, data: bytes) -> None:
        if self.phase is not Phase.STREAMING:  # the per-token path looks nothing up
            if not self.move(_I.RESPONSE_BODY):
                return
            self.deadlines.upstream_at = self.fx.now  # HOLDING: held until a content event
            assert self.survival is not None and self.survival.held is not None
            released = self.survival.held.take(data)
            if released is None:  # still held; an error event fails over (``placement.py``)
                placement.error_event_first(self, self.survival.held)
                return
            data = released
            self._commit()
        now = self.fx.now
        self.deadlines.upstream_at = now
        if self.first_byte_at is None:
            self.first_byte_at = now
            self.fx.cancel_timer((ExchangeTimer.FIRST_TOKEN, self.ident))
        self.bytes_out += len(data)
        meter = self.meter
        if meter is not None:
            meter.feed(data, now)
        usage = self.usage
        if usage is not None:
            usage.feed(data)
        heartbeat = self.heartbeat
        if heartbeat is not None:
            heartbeat.boundary.feed(data)
        if self.survival is not None:  # resume or continuation: one test on the per-token path
            data = surviving.keep(self, data)
            if not data:
                return
        client = self.client
        client.send_body(self.stream, data)
        upstream = self.upstream
        if upstream is not None and self.response_flow.filled(
            client.buffered(self.stream), self.fx.limits
        ):
            upstream.pause()
            client.hold(self)

    def client_stalled(self) -> bool:
        """The client connection is behind (``ClientStream.client_stalled``): stop our backend."""
        if self.phase is not Phase.STREAMING and not self.move(_I.CLIENT_STALLED):
            return False
        upstream = self.upstream
        if upstream is not None and self.response_flow.stop():
            upstream.pause()
            return True
        return False

    def client_drained(self) -> None:
        """The client side wrote some of this stream's bytes; maybe read the backend again."""
        if self.phase is not Phase.STREAMING and not self.move(_I.CLIENT_DRAINED):
            return
        upstream = self.upstream
        client = self.client
        if (
            upstream is not None
            and self.response_flow.stopped
            # The connection's gate first: ``drained`` resumes the flow when it says yes.
            and not client.congested
            and self.response_flow.drained(client.buffered(self.stream), self.fx.limits)
        ):
            upstream.resume()
            self.deadlines.resumed_at = self.fx.now  # its timers count from here
            client.release(self)

    def response_end(self, trailers: Headers) -> None:
        if not self.move(_I.RESPONSE_END):
            return
        if self.phase is Phase.HOLDING:
            assert self.survival is not None and self.survival.held is not None
            held = self.survival.held.held
            self._commit()
            if held:
                self.response_body(held)
        if self.phase is Phase.DONE:  # the held bytes ended it (``_keep``)
            return
        if self.survival is not None:
            surviving.end(self)
        # RFC 9110 §6.5.1: only trailer fields either protocol can carry go on.
        self.client.send_end(self.stream, trailer_fields(trailers) if trailers else trailers)
        self.release_upstream(close=False)
        self._finish("ok")

    def upstream_failed(self, reason: str, *, timeout: bool = False, stale: bool = False) -> None:
        """The backend connection broke, could not be opened, or timed out."""
        if not self.move(_I.UPSTREAM_FAILED):
            return
        # A reused keep-alive connection failed before any response byte: once, a new
        # connection to the same server, if the request may go again (``failover.py``).
        if stale and self.phase is Phase.WAITING_HEAD and placement.retry_stale(self, reason):
            pass
        elif self.phase is not Phase.STREAMING:
            placement.retry_or_fail(self, "timeout" if timeout else "error", reason)
        elif self.answer is not None and surviving.continue_answer(self, reason):
            pass  # the next server finishes the answer (``continuing.py``)
        else:
            if self.failover is not None:
                self.failover.failed_mid_stream()
            if self.resumable is not None:
                self.host.resumes.ended(self.resumable, State.BROKEN)
            self.release_upstream(close=True)
            # Truncation must be visible: never a clean end for a broken stream. (On HTTP/1.1
            # that is the close, which comes once this exchange is over: ``request_close``.)
            self.client.abort(self.stream)
            self._finish(f"upstream failed mid-stream: {reason}", cut=True)

    # -- timers (``deadlines.py``) ----------------------------------------------------------

    def timer_fired(self, kind: ExchangeTimer) -> None:
        if not self.move(TIMER_INPUTS[kind]):
            return
        match kind:
            case _T.CONNECT | _T.HEAD | _T.FIRST_TOKEN | _T.READ:
                assert self.group is not None
                sending, held = self.upload.sending, self.client.holds(self)
                if self.deadlines.backend_expired(kind, self.group, sending=sending, held=held):
                    self.upstream_failed(BACKEND_TIMEOUTS[kind], timeout=True)
            case _T.HEARTBEAT:
                assert self.heartbeat is not None  # armed for such a stream alone
                self.heartbeat.fired(self.client, self.stream)
            case _T.DEADLINE:
                self._deadline_exceeded()
            case _T.BODY:
                if (slow := self.upload.stalled()) is not None:
                    self._refuse_slow_body(slow)
            case _T.QUEUE:
                placement.queue_timeout(self)
            case _T.TUNNEL:  # the table refuses it: a tunnel's (``websocket.py``)
                pass
            case _:
                assert_never(kind)

    def _deadline_exceeded(self) -> None:
        """The gRPC call's ``grpc-timeout`` passed: DEADLINE_EXCEEDED in any phase."""
        self.deadlines.end_attempt()
        self.release_upstream(close=True)
        if self.phase is not Phase.STREAMING:
            self.fail(504, "deadline exceeded (grpc-timeout)")
            return
        self.move(_I.FINISH)
        fields = grpc.status_fields(grpc.DEADLINE_EXCEEDED, "deadline exceeded (grpc-timeout)")
        self.client.send_end(self.stream, fields)
        self._wrap_up("grpc-timeout exceeded")

    def _refuse_slow_body(self, slow: SlowBody) -> None:
        """A request body too slow (``bodyclock.py``) while no response began (the table
        ignores the ``body`` timer from then on): the client side refuses it."""
        api = self.route.api if self.route is not None else None
        sent = self.client.refuse_slow_body(self.stream, slow, api=api, request_id=self.request_id)
        if sent is not None:
            self.status = 408
            self.bytes_out += sent
        self.client_aborted(slow.reason)

    # -- endings ---------------------------------------------------------------------------

    def fail(
        self, status: int, text: str, reason: str = "", *, extra: Fields = (), body: Own = None
    ) -> None:
        """Our own answer, while no response head went out (``heads.send_error_answer``)."""
        self.status, sent = send_error_answer(
            self.client,
            self.head,
            status,
            text,
            api=self.route.api if self.route is not None else None,
            request_id=self.request_id,
            date=self.fx.http_date(),
            extra=extra,
            rewrite=self.hooks.own_answers if self.hooks is not None else None,  # ``hooked.py``
            body=body,
        )
        self.bytes_out += sent
        self.move(_I.FAIL)
        self._wrap_up(reason or text)

    def release_upstream(self, *, close: bool) -> None:
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.exchange = None
            # Whoever stopped it, its reading is not ours to resume any more (released to the
            # pool it is resumed there); a next attempt's backend starts running.
            self.response_flow.resume()
            self.client.release(self)
            if close or self.upload.phase is not RequestPhase.COMPLETE:
                upstream.close()
            else:
                upstream.release()
        elif self.failover is not None and self.phase is Phase.CONNECTING:
            self.host.pool.forget(self)

    def _finish(self, outcome: str, *, cut: bool = False) -> None:
        self.move(_I.FINISH)
        self._wrap_up(outcome, cut=cut)

    def _wrap_up(self, outcome: str, *, cut: bool = False) -> None:
        """The exchange is DONE: timers, the server's count, the client's credit, the
        owner's tables, the measurements and the access record. ``cut``: the client did not
        get a whole response (an answer of our own, ``fail``, is whole)."""
        self.outcome = outcome
        self.deadlines.end_attempt()
        self.deadlines.cancel(ExchangeTimer.DEADLINE, ExchangeTimer.BODY)
        self.let_go()
        failover = self.failover
        if failover is not None:
            admission = self.admission
            if admission is not None:
                events = self.meter.tokens if self.meter is not None else None
                placement.settle(self, admission, failover, self.head_at is not None, events)
            failover.leave()
        self.upload.settle()
        self.host.exchange_finished(self)  # and its extensions' ``on_finish``
        self.client.exchange_finished(self)
        add_to_totals(self.host.measurements, self, cut=cut)
        self.fx.emit(Log(event="access", fields=access_fields(self, outcome)))
