"""The phases of ``Exchange`` as data: ``core/exchange/exchange_states.py`` and the exchange that
obeys it.

In the manner of h2's ``test_state_machines.py``: Hypothesis draws every (phase, input) pair
of the table. A real ``ProxyCore`` conversation (an HTTP/1.1 or HTTP/2 client, HTTP/1.1
backends) brings an exchange into the phase; the input is then given by the entry point that
delivers it in the code (the method the client side, the pool or a timer calls; an armed
timer by its ``Wakeup``), and the exchange must do what the table says:

- a taken event: its first step is the table's, and every move it makes after it is one the
  table allows, ending in the phase the exchange is in;
- an ignored one: no command, nothing of the exchange changed (what the input offered is
  handed back: a backend stream closed, HTTP/2 request body credit acknowledged);
- an illegal one: ``IllegalTransition`` naming the pair, the phase unchanged.

Moves (the exchange's own decisions) are fed to ``move`` itself. Inputs that the per-token
path takes without a lookup (``FAST``) must be ones the table takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import h2.events
import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from machines import Moves, spy
from playbook import H1BackendPeer, H2Client, Playbook, default_config

from muxproxy.config import (
    Config,
    FleetSettings,
    GroupTimeouts,
    NextUpstream,
    RateLimit,
    Route,
    Server,
    SessionSource,
    Sticky,
    Upstream,
)
from muxproxy.config.extensions import ExtensionConfig
from muxproxy.core.commands import BudgetSettle, Command, SendData
from muxproxy.core.events import BudgetAnswered, ExtensionAnswered, Wakeup
from muxproxy.core.exchange import placement
from muxproxy.core.exchange.exchange import Exchange, Phase, RequestPhase
from muxproxy.core.exchange.exchange_states import EVENTS, TIMER_INPUTS, TRANSITIONS, ExchangeInput
from muxproxy.core.exchange.hooked import ExchangeHooks
from muxproxy.core.messages import Headers, ResponseHead
from muxproxy.core.ports import UpstreamUser
from muxproxy.core.states import IGNORED, ILLEGAL, IllegalTransition, Verdict, missing
from muxproxy.core.timers import CoreTimer
from muxproxy.extensions import Answer, Decision, Extension, Request
from muxproxy.fleet.budgets import Ask, Short
from muxproxy.fleet.budgets import Verdict as StoreVerdict
from muxproxy.routing.ratelimit import Budget

_I = ExchangeInput
PAIRS = [(phase, input) for phase in Phase for input in ExchangeInput]
MOVES = frozenset(ExchangeInput) - EVENTS
FAST = frozenset({_I.RESPONSE_BODY, _I.UPSTREAM_DRAINED, _I.CLIENT_STALLED, _I.CLIENT_DRAINED})
"""Taken while STREAMING without a lookup (the per-token path)."""
TIMERS = {input: kind for kind, input in TIMER_INPUTS.items()}

EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
KEYED = ("x-session", "k1")
"""A session key in the head: a request with a body is routed at once."""


STORE = "redis://127.0.0.1:1"
"""The fleet store of a rig whose exchange waits for it (never reached: answers are fed)."""
BUDGET = Budget(max_concurrent=4)


class Waits(Extension):
    """An extension whose async request-head hook the tests answer themselves."""

    async def on_request_head_async(self, request: Request) -> Decision | None:
        return None


def config(*, fleet: bool = False, hook: bool = False) -> Config:
    """Two servers of one stream each (a failure is retried; a third request waits), a held
    SSE head with heartbeats, a first-token timeout, and a session key from a header or
    else the JSON body. ``fleet``: with a fleet store and a tenant budget (RESERVING)."""
    servers = (
        Server(address="127.0.0.1:9001", max_streams=1),
        Server(address="127.0.0.1:9002", max_streams=1),
    )
    sources = (
        SessionSource(kind="header", name="x-session"),
        SessionSource(kind="body", name="session"),
    )
    group = Upstream(
        name="default",
        servers=servers,
        pool_max_idle=0,
        sticky=Sticky(sources=sources),
        timeouts=GroupTimeouts(first_token=30.0),
        next_upstream=NextUpstream(on=frozenset({"error", "timeout", "http_503"})),
        rate_limit=RateLimit(max_concurrent=4) if fleet else None,
    )
    route = Route(prefix="/", upstream="default", retry_until_first_event=True, sse_heartbeat=15)
    store = FleetSettings(store=STORE) if fleet else None
    waits = (ExtensionConfig(module="tests:Waits", instance=Waits({})),) if hook else ()
    return default_config(
        upstreams={"default": group}, routes=(route,), fleet=store, extensions=waits
    )


# -- bringing an exchange into a phase -----------------------------------------------------


class Rig:
    """One client connection (1) with one request, and the backend that answers it."""

    def __init__(self, *, h2: bool, fleet: bool = False, hook: bool = False) -> None:
        self.pb = Playbook(config(fleet=fleet, hook=hook))
        self.h2client = H2Client(self.pb, 1) if h2 else None
        if self.h2client is None:
            self.pb.accept(1)
        self.h1client = h11.Connection(h11.CLIENT)
        self.backend = H1BackendPeer()
        self.up = 0
        self.stub: StubStream | None = None

    def request(self, *, body: bytes | None, keyed: bool = True) -> Exchange:
        """A GET (``body`` None), or a POST whose ``body`` is the start of one still coming
        (chunked); ``keyed``: with the session key in the head."""
        fields = [KEYED] if keyed else []
        if self.h2client is not None:
            peer = self.h2client.peer.conn
            sid = peer.get_next_available_stream_id()
            method = b"GET" if body is None else b"POST"
            head = [(b":method", method), (b":scheme", b"http"), (b":authority", b"p")]
            head += [(b":path", b"/v1/stream")]
            head += [(n.encode(), v.encode()) for n, v in fields]
            peer.send_headers(sid, head, end_stream=body is None)
            if body is not None:
                peer.send_data(sid, body)
            self.h2client.send()
        else:
            client = self.h1client
            if body is None:
                get = h11.Request(method="GET", target="/v1/stream", headers=[("Host", "p")])
                out = client.send(get)
                out = (out or b"") + (client.send(h11.EndOfMessage()) or b"")
            else:
                headers = [("Host", "p"), ("Transfer-Encoding", "chunked"), *fields]
                out = client.send(h11.Request(method="POST", target="/v1/stream", headers=headers))
                out = (out or b"") + (client.send(h11.Data(data=body)) or b"")
            self.pb.receive(1, out)
        (exchange,) = self.pb.core.exchanges.values()
        return exchange

    def connect(self) -> None:
        (opening,) = self.pb.opens()
        self.up = opening.conn
        self.pb.opened(self.up)
        self.backend.events(self.pb.take(self.up))

    def answer(self, *, sse: bool) -> None:
        kind = "text/event-stream" if sse else "application/json"
        head = h11.Response(status_code=200, headers=[("Content-Type", kind)])
        self.pb.receive(self.up, self.backend.conn.send(head) or b"")

    def settle(self) -> list[Command]:
        """Hand the core an event that does nothing itself: it applies the work deferred by a
        call made outside ``handle`` and returns the commands queued since the last event."""
        return self.pb.feed(Wakeup(now=self.pb.now, timer=(CoreTimer.SHUTDOWN, -1)))

    def later(self, seconds: float) -> None:
        """Move the core's clock (by a ``settle``)."""
        self.pb.now += seconds
        self.settle()


def fill(rig: Rig, streams: int) -> None:
    """Count ``streams`` streams on each server, as if other clients ran them there."""
    router = rig.pb.core.router(rig.pb.core.config.upstreams["default"])
    router.active[:] = [streams] * len(router.active)


def reach(
    phase: Phase,
    *,
    h2: bool,
    open_request: bool,
    sse: bool,
    full: bool = False,
    fleet: bool = False,
) -> tuple[Rig, Exchange]:
    """A conversation that leaves its exchange in ``phase``. ``open_request``: its request
    body is still coming; ``sse``: the backend answers with an SSE head (held, then committed
    by its first event) rather than a JSON one (committed at once, before any body byte);
    ``full``: every server is full (QUEUED is reached so; BUFFERING then routes into the
    queue); ``fleet``: with a fleet store and a budget (RESERVING is reached so; BUFFERING
    then routes into RESERVING)."""
    rig = Rig(h2=h2, fleet=fleet or phase is Phase.RESERVING, hook=phase is Phase.AWAITING_HOOK)
    if phase is Phase.AWAITING_HOOK:  # an extension's async hook runs (``hooked.py``)
        exchange = rig.request(body=b'{"a": 1' if open_request else None)
        assert exchange.phase is Phase.AWAITING_HOOK
        return rig, exchange
    if phase is Phase.RESERVING:
        exchange = rig.request(body=b'{"a": 1' if open_request else None)
        assert exchange.phase is Phase.RESERVING
        return rig, exchange
    if full or phase is Phase.QUEUED:
        fill(rig, 1)
    if phase is Phase.QUEUED:
        exchange = rig.request(body=b'{"a": 1' if open_request else None)
        assert exchange.phase is Phase.QUEUED
        return rig, exchange
    if phase is Phase.BUFFERING:
        exchange = rig.request(body=b'{"sess', keyed=False)
        assert exchange.phase is Phase.BUFFERING
        return rig, exchange
    exchange = rig.request(body=b'{"a": 1' if open_request else None)
    assert exchange.request is (RequestPhase.BODY if open_request else RequestPhase.COMPLETE)
    if phase is not Phase.CONNECTING:
        rig.connect()
        if phase is not Phase.WAITING_HEAD:
            rig.answer(sse=sse or phase is Phase.HOLDING)
            if phase is not Phase.HOLDING:
                if sse:
                    rig.pb.receive(rig.up, rig.backend.chunk(EVENT))
                if phase is Phase.DONE:
                    rig.pb.receive(rig.up, rig.backend.end())
    assert exchange.phase is phase, (exchange.phase, phase)
    return rig, exchange


@attrs.define
class StubStream:
    """A backend stream offered by hand (``ports.UpstreamStream``): records what it gets."""

    exchange: UpstreamUser | None = None
    http_version: bytes = b"1.1"
    pending: int = 0
    paused: bool = False
    written: bool = True
    closed: bool = False
    sent: list[object] = attrs.Factory(list)

    def send_head(self, stream: int, method: bytes, target: bytes, headers: Headers) -> None:
        self.sent.append((method, target))

    def send_body(self, data: bytes) -> None:
        self.sent.append(data)

    def send_end(self, trailers: Headers) -> None:
        self.sent.append("end")

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        self.sent.append("released")


# -- giving it the input -------------------------------------------------------------------


def heads(stream: int) -> list[ResponseHead]:
    """What a backend may answer: an SSE head (held), a JSON one, a 503 (retried)."""
    return [
        ResponseHead(stream=stream, status=200, headers=[(b"content-type", b"text/event-stream")]),
        ResponseHead(stream=stream, status=200, headers=[(b"content-type", b"application/json")]),
        ResponseHead(stream=stream, status=503, headers=[]),
    ]


def delivery(rig: Rig, exchange: Exchange, input: ExchangeInput, variant: int) -> Callable[[], Any]:
    """The call that gives ``exchange`` the event ``input`` (``variant`` picks among what it
    may carry)."""
    match input:
        case _I.UPSTREAM_READY:
            stub = rig.stub = StubStream()
            return lambda: exchange.upstream_ready(stub)
        case _I.UPSTREAM_DRAINED:
            return exchange.upstream_drained
        case _I.RESPONSE_HEAD:
            head = heads(exchange.stream)[variant]
            return lambda: exchange.response_head(head)
        case _I.RESPONSE_BODY:
            return lambda: exchange.response_body(EVENT)
        case _I.RESPONSE_END:
            return lambda: exchange.response_end([])
        case _I.UPSTREAM_FAILED:
            timeout, stale = variant == 1, variant == 2
            return lambda: exchange.upstream_failed("broken", timeout=timeout, stale=stale)
        case _I.REQUEST_BODY:
            # HTTP/2 DATA carries flow-controlled bytes; an HTTP/1.1 body none (h1.py).
            flow_len = 16 if rig.h2client is not None else 0
            return lambda: exchange.request_body(b' "session": "s1"', flow_len)
        case _I.REQUEST_END:
            return lambda: exchange.request_end([])
        case _I.CLIENT_ABORTED:
            return lambda: exchange.client_aborted("the test's client left")
        case _I.CLIENT_STALLED:
            return exchange.client_stalled
        case _I.CLIENT_DRAINED:
            return exchange.client_drained
        case _I.ADMITTED:
            if variant == 1:
                fill(rig, 0)  # a server has room: it is tried
            return exchange.admitted
        case _I.RESERVED:
            # Reserved (every server full: it waits), refused, or the store failed
            # (``on_store_error = "local"``: tried at once).
            if variant == 0:
                fill(rig, 1)
            ask = Ask(request=exchange.ident, group="default", tenant=0, budget=BUDGET, tokens=1)
            short = (Short(0), Short.CONCURRENCY)[variant] if variant < 2 else None
            verdict = None
            if short is not None:
                verdict = StoreVerdict(short=short, wait=1.0, tokens=0, requests=0, held=1)
            answer = BudgetAnswered(
                now=rig.pb.now, store=STORE, ask=ask, verdict=verdict, error="down", replicas=2
            )
            return lambda: exchange.budget_answered(answer)
        case _I.HOOK_ANSWERED:
            # The hook let it go on, failed (``reject``: 503), or answered (401).
            hooks = exchange.hooks or ExchangeHooks(config(hook=True).extensions, exchange)
            decision = Decision(answer=Answer(status=401, message="no")) if variant == 2 else None
            answered = ExtensionAnswered(
                now=rig.pb.now,
                request=exchange.ident,
                position=0,
                decision=decision,
                error="timed out" if variant == 1 else "",
            )

            def hook_answered() -> None:
                if hooks.answered(exchange, answered):
                    placement.begin(exchange)

            return hook_answered
    kind = TIMERS[input]
    timer = (kind, exchange.ident)
    if timer in rig.pb.core.fx.timers and exchange.ident in rig.pb.core.exchanges:
        return lambda: rig.pb.feed(Wakeup(now=rig.pb.now, timer=timer))  # armed: its wakeup
    return lambda: exchange.timer_fired(kind)


def snapshot(exchange: Exchange) -> tuple[object, ...]:
    """What an ignored input must leave as it was."""
    failover = exchange.failover
    return (
        exchange.phase,
        exchange.request,
        exchange.status,
        exchange.bytes_in,
        exchange.bytes_out,
        exchange.outcome,
        exchange.upstream,
        exchange.response,
        exchange.first_byte_at,
        exchange.head_at,
        attrs.astuple(exchange.response_flow),
        attrs.astuple(exchange.upload.flow),
        exchange.upload.body.size,
        exchange.upload.body.unsent_size,
        attrs.astuple(exchange.deadlines, filter=lambda field, _: field.name != "fx"),
        None if failover is None else (failover.tries, failover.server, failover.stale_retried),
    )


def check(
    phase: Phase, input: ExchangeInput, *, h2: bool, open_request: bool, variant: int
) -> Moves:
    """Bring an exchange into ``phase``, give it ``input``, and check the table's word."""
    # JSON is committed at once, before any body byte (the first-token timer still runs); an
    # SSE head is held until its first event, and its stream gets heartbeats.
    sse = input is _I.HEARTBEAT_TIMER or (variant != 1 and input is not _I.FIRST_TOKEN_TIMER)
    # Body bytes come only while the body does (the client side's adapters see to that).
    open_request = open_request or input is _I.REQUEST_BODY
    full = phase is Phase.BUFFERING and variant == 2
    fleet = phase is Phase.BUFFERING and variant == 1
    rig, exchange = reach(phase, h2=h2, open_request=open_request, sse=sse, full=full, fleet=fleet)
    if variant == 2:
        rig.later(1000.0)  # the lazy deadlines have passed
    if rig.h2client is not None:
        rig.h2client.read()  # what came before the input is the conversation's
    moves = spy(exchange)
    target = TRANSITIONS[(phase, input)]
    before = snapshot(exchange)
    deliver = (
        (lambda: exchange.move(input))
        if input in MOVES
        else delivery(rig, exchange, input, variant)
    )
    if target is ILLEGAL:
        with pytest.raises(IllegalTransition) as refused:
            deliver()
        assert (refused.value.state, refused.value.input) == (phase, input)
        assert exchange.phase is phase
        return moves
    result = deliver()
    commands = (result if isinstance(result, list) else []) + rig.settle()
    if target is IGNORED:
        assert moves == [(phase, input, phase)]
        assert snapshot(exchange) == before
        assert result is None or result is False or isinstance(result, list)
        assert handed_back(rig, exchange, input, commands)
        return moves
    if not moves:
        # The per-token path: taken without a lookup, in the phase the table takes it in.
        assert (phase, input, target) == (Phase.STREAMING, input, Phase.STREAMING)
        assert input in FAST and exchange.phase is Phase.STREAMING
        return moves
    assert moves[0] == (phase, input, target)
    for was, later, now in moves[1:]:
        then = TRANSITIONS[(was, later)]
        assert then is not ILLEGAL
        assert now is (was if then is IGNORED else then), (was, later, now)
    assert exchange.phase is moves[-1][2]
    return moves


def handed_back(
    rig: Rig, exchange: Exchange, input: ExchangeInput, commands: list[Command]
) -> bool:
    """An ignored input caused nothing but the return of what it brought."""
    if input is _I.RESERVED:
        # What the store reserved for an exchange that ended goes back, and nothing else.
        assert all(isinstance(c, BudgetSettle) for c in commands)
        return True
    if input is _I.UPSTREAM_READY:
        assert rig.stub is not None and rig.stub.closed and rig.stub.sent == []
    if input is _I.REQUEST_BODY and rig.h2client is not None:
        # The body's HTTP/2 credit goes back (RFC 9113 §6.9): a WINDOW_UPDATE if h2 finds one
        # due (the stream is closed: the connection's window), nothing else.
        assert all(isinstance(c, SendData) and c.conn == 1 for c in commands)
        assert all(isinstance(e, h2.events.WindowUpdated) for e in rig.h2client.read())
        return True
    assert commands == []
    return True


# -- the table ---------------------------------------------------------------------------


def test_the_table_lists_every_pair() -> None:
    assert missing(TRANSITIONS, Phase, ExchangeInput) == []
    assert len(TRANSITIONS) == len(Phase) * len(ExchangeInput)
    for (phase, input), target in TRANSITIONS.items():
        assert isinstance(phase, Phase) and isinstance(input, ExchangeInput)
        assert isinstance(target, (Phase, Verdict))


def test_an_event_is_taken_ignored_or_refused_and_a_move_never_ignored() -> None:
    for (phase, input), target in TRANSITIONS.items():
        if input in EVENTS:
            assert target in (phase, IGNORED, ILLEGAL), (phase, input)
        else:
            assert target is not IGNORED, (phase, input)


def test_done_ignores_every_event_and_refuses_every_move() -> None:
    for input in ExchangeInput:
        assert TRANSITIONS[(Phase.DONE, input)] is (IGNORED if input in EVENTS else ILLEGAL)


def test_nothing_is_retried_or_answered_by_us_once_the_head_went_out() -> None:
    for input in (_I.RETRY, _I.FAIL, _I.HOLD, _I.COMMIT):
        assert TRANSITIONS[(Phase.STREAMING, input)] is ILLEGAL


def test_the_per_token_path_takes_only_what_the_table_takes() -> None:
    for input in FAST:
        assert TRANSITIONS[(Phase.STREAMING, input)] is Phase.STREAMING


# -- the exchange ----------------------------------------------------------------------------


# Every pair, each way of reaching its phase and each variant of the input: 2,520 cases, a
# space small enough that Hypothesis draws all of them and stops ("nothing left to do").
EVERY_PAIR = settings(max_examples=3000, deadline=None)


@EVERY_PAIR
@given(
    pair=st.sampled_from(PAIRS),
    h2=st.booleans(),
    open_request=st.booleans(),
    variant=st.integers(0, 2),
)
def test_every_pair_does_what_the_table_says(
    pair: tuple[Phase, ExchangeInput], h2: bool, open_request: bool, variant: int
) -> None:
    phase, input = pair
    check(phase, input, h2=h2, open_request=open_request, variant=variant)


def test_every_move_the_table_allows_is_made_by_some_conversation() -> None:
    """No dead entry: each move the table allows is one that some event takes, in some
    conversation (the HTTP/1.1 ones, every pair in turn)."""
    taken: set[tuple[Phase, ExchangeInput]] = set()
    for phase, input in PAIRS:
        for open_request in (False, True):
            for variant in (0, 1, 2):
                moves = check(phase, input, h2=False, open_request=open_request, variant=variant)
                if input in EVENTS:
                    taken |= {(was, made) for was, made, _ in moves if made in MOVES}
    # The first attempt from an exchange just started, BUFFER and RESERVE, are taken as it
    # starts;
    # REPLAY as a resume starts (tests/e2e/test_resume_e2e.py), also once the body's model
    # found the route (tests/core/test_bymodel.py); AWAIT_HOOK as an extension's
    # async hook starts (``reach``, tests/core/test_hooks.py), also once the body's model found
    # the route (tests/core/test_bymodel.py).
    taken |= {
        (Phase.BUFFERING, _I.AWAIT_HOOK),
        (Phase.BUFFERING, _I.REPLAY),
        (Phase.CONNECTING, _I.AWAIT_HOOK),
        (Phase.CONNECTING, _I.ATTEMPT),
        (Phase.CONNECTING, _I.BUFFER),
        (Phase.CONNECTING, _I.QUEUE),
        (Phase.CONNECTING, _I.REPLAY),
        (Phase.CONNECTING, _I.RESERVE),
    }
    allowed = {(p, i) for (p, i), t in TRANSITIONS.items() if i in MOVES and t is not ILLEGAL}
    assert allowed - taken == set()
