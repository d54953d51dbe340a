"""Where an exchange goes: its route, its group's budgets and admission queue, its servers.

What it obeys:

- ``GET /v1/models`` and ``GET /v1/models/{id}`` are answered by the proxy itself while it
  knows a model (``apis/modellist.py``), once a route took the request and the extensions'
  request-head hooks let it go on (an authenticating extension guards the list as any
  request), before its group is asked; otherwise they are routed as before.
- Routing: the route is chosen by the normalised path (``paths.py``), and that path is what
  the backend gets; with routes by model or aliases, by the body's model too, read first
  (BUFFERING without a route: ``bymodel.py``). A group that reads the request's JSON body
  (a body session key, ``least_load``, prefix affinity, token budgets, load reports: a LoRA
  adapter's name) holds its start first (BUFFERING) until the body is complete or as much of
  it is held as may be (``sticky.body_limit``, bounded by ``high_water``); a body longer than
  that is read for its facts from its first members (``routing/partialbody.py``).
- Budgets (``admit.py``): a tenant whose budget is spent gets 429 with its ``Retry-After``;
  with the fleet's budgets the shared store answers first (RESERVING, ``fleetadmit.py``).
  Every refusal for want of room, budget or server says why (``refusal.py``: the
  ``x-muxproxy-reason`` field, the body in the request's API's error shape).
- Admission: a request every candidate of whose group is full waits in the group's queue
  (QUEUED), or gets 429 when the queue is full or its wait runs out (``queue.retry_after``).
  A request the queue admits is routed again, with the group as configured now.
- The servers, in the group's order (``failover.py``): no usable one is 503; a try that
  fails before anything reached the client goes to the next one where ``next_upstream``
  allows (RFC 9110 §9.2.2), else 504 for a timeout and 502 for any other failure. An SSE
  response held until its first content event (``retry_until_first_event``) whose backend
  reports an error event first (``commit.py``: an ``overloaded_error``) failed so too, as
  ``"error"``; with no try left its stream is relayed as the backend sent it.

It sees the exchange through ``exchangeports.Routed`` alone: it sets the members it decides
(the normalised head, the route, the group, the failover, the admission) and moves the
exchange's phase through ``move``, so the exchange's table still says what may happen when.
Functions, not an object per exchange: the per-request path makes no record for them.
"""

from __future__ import annotations

import attrs

from muxproxy.config import Config
from muxproxy.core.apis import modellist
from muxproxy.core.apis.streaming import OPENAI_LIKE, stream_for
from muxproxy.core.events import BudgetAnswered
from muxproxy.core.exchange import bymodel, fleetadmit
from muxproxy.core.exchange.admit import (
    Admission,
    UsageScan,
    extra_fields,
    repeated_tenant_field,
)
from muxproxy.core.exchange.body import RequestBody
from muxproxy.core.exchange.exchange_states import ExchangeInput
from muxproxy.core.exchange.exchangeports import Routed
from muxproxy.core.exchange.failover import Failover
from muxproxy.core.exchange.refusal import Reason, refuse
from muxproxy.core.http import grpc
from muxproxy.core.http.intake import MalformedRequest
from muxproxy.core.http.paths import normalise_target
from muxproxy.core.ports import RequestPhase
from muxproxy.core.streams.commit import CommitPoint
from muxproxy.core.timers import ExchangeTimer
from muxproxy.core.upstream import kvfeeds
from muxproxy.routing.balancer import rendezvous_order
from muxproxy.routing.llmrequest import parse_json_body
from muxproxy.routing.partialbody import leading_document
from muxproxy.routing.ratelimit import Refusal
from muxproxy.routing.sticky import session_key_from_body, session_key_from_head

_I = ExchangeInput


def locate(exchange: Routed) -> bool:
    """Find the route and the group (False: answered with an error instead, or the body's
    model is read first: ``route_by_body`` goes on)."""
    fx = exchange.fx
    head = exchange.head
    timeout = grpc.grpc_timeout(head.headers) if grpc.is_grpc(head.headers) else None
    if timeout is not None:
        # The whole call's deadline, across retries (gRPC's grpc-timeout).
        fx.set_timer((ExchangeTimer.DEADLINE, exchange.ident), fx.now + timeout)
    try:
        target = normalise_target(head.target)
    except MalformedRequest as exc:
        exchange.fail(exc.status, exc.reason)
        return False
    if target is not head.target:
        # Routed and forwarded as normalised (paths.py): the backend has nothing left to
        # resolve that could take it out of the route's prefix.
        head = exchange.head = attrs.evolve(head, target=target)
    if fx.config.reads_models and bymodel.reads_model(exchange):  # no call where it is off
        bymodel.hold_for_model(exchange)
        return False
    route = exchange.route = fx.config.route_for(head.target)
    if route is None:
        exchange.fail(404, "no route for this path")
        return False
    group = exchange.group = fx.config.upstreams[route.upstream]
    exchange.upload.body = RequestBody(group.next_upstream.replay_buffer)
    hooks = exchange.hooks  # extensions may answer, rewrite, pick the group, or wait
    return hooks is None or hooks.request_head(exchange)


def _answer_models(exchange: Routed) -> bool:
    """``GET /v1/models`` (or one model), answered here while any model is known
    (``apis/modellist.py``); False: not ours, routed as any request."""
    fx = exchange.fx
    known = fx.models.known(fx.config.upstreams.values(), model_aliases(fx.config))
    answer = modellist.models_answer(exchange.head, known)
    if answer is None:
        return False
    status, body = answer
    exchange.fail(status, "models listed by the proxy", body=body)
    return True


def usage_scan(exchange: Routed) -> UsageScan | None:
    """What reads the response's token counts: its admission's (a token budget), else one of
    its own where telemetry records them (``docs/telemetry.md``); None: nothing needs them."""
    admission = exchange.admission
    if admission is not None and admission.usage is not None:
        return admission.usage
    if exchange.fx.config.telemetry is None:
        return None
    return UsageScan(stream_for(exchange.head.target) or OPENAI_LIKE)


def model_aliases(config: Config) -> tuple[str, ...]:
    """The model names the configuration itself gives, listed beside the models the groups
    serve: the routes' exact ``models`` (not their globs, which name no one model) and the
    ``[models.NAME]`` aliases."""
    exact = (
        name
        for route in config.routes
        for name in route.models
        if not any(glob in name for glob in "*?[")
    )
    return (*exact, *config.models)


def begin(exchange: Routed) -> None:
    """Route, reading the body first where the group needs it."""
    if exchange.head.target.startswith(modellist.PATH) and _answer_models(exchange):
        return
    group, head = exchange.group, exchange.head
    assert group is not None
    key, need_body = session_key_from_head(group.sticky.sources, head.headers, head.target)
    if (need_body or group.reads_body) and exchange.upload.phase is RequestPhase.BODY:
        exchange.move(_I.BUFFER)
        return
    _route(exchange, key, None)


def route_by_body(exchange: Routed) -> None:
    """BUFFERING: route once the body is complete or as much of it is held as may be (its
    model first, where it decides the route: ``bymodel.py``)."""
    if exchange.route is None:
        if not bymodel.read_model(exchange) or exchange.routed_by_model():
            return  # more body needed, answered, or a resume took it (``replay.py``)
        hooks = exchange.hooks
        if hooks is not None and not hooks.request_head(exchange):
            return
        group, head = exchange.group, exchange.head
        assert group is not None
        key, need_body = session_key_from_head(group.sticky.sources, head.headers, head.target)
        if not (need_body or group.reads_body) or exchange.upload.phase is not RequestPhase.BODY:
            _route(exchange, key, None)
            return
    group, head, upload = exchange.group, exchange.head, exchange.upload
    body = upload.body
    assert group is not None
    complete = upload.phase is RequestPhase.COMPLETE
    if complete or body.size >= min(group.sticky.body_limit, exchange.fx.limits.high_water):
        prefix = body.prefix()
        document = parse_json_body(prefix) if complete else None
        sources = group.sticky.sources
        key = session_key_from_body(sources, head.headers, head.target, prefix, complete, document)
        if document is None and group.admits:
            # Longer than may be held: its facts from its first members (a long
            # conversation keeps its prefix key, and so its server).
            document = leading_document(prefix)
        _route(exchange, key, document)


def _route(exchange: Routed, key: bytes | None, document: object | None) -> None:
    """Route with the session ``key``; ``document``: the parsed body, if it was read."""
    group = exchange.group
    assert group is not None
    admission = None
    if group.admits:
        if (repeated := repeated_tenant_field(group, exchange.head)) is not None:
            exchange.fail(400, repeated)
            return
        fx, host = exchange.fx, exchange.host
        admission = exchange.admission = Admission(fx, group, exchange.head, document)
        exchange.upload.model = exchange.upload.model or admission.facts.model  # the record's
        if exchange.hooks is not None and exchange.hooks.tenant is not None:
            admission.tenant = exchange.hooks.tenant  # an extension's (``hooked.py``)
        if fleetadmit.ask_store(fx, group, admission, exchange.ident, key):
            exchange.move(_I.RESERVE)  # the fleet's budgets: the store answers first
            return
        refusal = admission.reserve(host.router(group))
        if refusal is not None:
            _refuse_budget(exchange, refusal)
            return
        admission.count(host.measurements.group(group.name))
    _place(exchange, key, admission)


def budget_answered(exchange: Routed, event: BudgetAnswered) -> None:
    """RESERVING: the fleet store's answer (``fleetadmit.py``): route, or refuse."""
    if not exchange.move(_I.RESERVED):
        fleetadmit.give_back(exchange.fx, event)  # it ended meanwhile: the store's goes back
        return
    admission, group, host = exchange.admission, exchange.group, exchange.host
    assert admission is not None and group is not None and admission.fleet is not None
    router, measurements = host.router(group), host.measurements
    match fleetadmit.decide(exchange.fx, router, measurements, admission, event):
        case Refusal() as refusal:
            _refuse_budget(exchange, refusal)
        case str() as reason:
            exchange.fail(503, reason)
        case None:
            admission.count(measurements.group(group.name))
            _place(exchange, admission.fleet.key, admission)


def _place(exchange: Routed, key: bytes | None, admission: Admission | None) -> None:
    """Admitted: choose the servers, then try the first with room, or wait for one."""
    group = exchange.group
    assert group is not None
    failover = exchange.failover = Failover(
        exchange.fx,
        exchange.host,
        exchange,
        exchange.ident,
        group,
        exchange.head,
        exchange.upload.body,
        key,
        prefix=admission.prefix_key if admission else None,
        ticket=admission.ticket if admission else None,
        model=admission.facts.model if admission else None,
        conversation=admission.conversation if admission else None,
    )
    if not failover.candidates:
        refuse(exchange, Reason.NO_SERVER, 503, "no backend available")
        return
    if admission is not None and admission.tokenize is not None:
        assert admission.conversation is not None
        document, admission.tokenize = admission.tokenize, None
        kvfeeds.ask_tokens(
            exchange.fx, failover.router, failover.candidates[0], admission.conversation, document
        )
    if not _chosen(exchange, failover):
        return
    if group.admission and _waits_for_home(exchange, failover):
        _wait(exchange, for_home=True)
        return
    if group.admission and not failover.choose_room():
        _wait(exchange)
        return
    exchange.move(_I.ATTEMPT)
    failover.attempt()


def _chosen(exchange: Routed, failover: Failover) -> bool:
    """Each placement (the first, a retry, an admission from the queue): the extensions'
    ``choose_server`` may put one of the servers left first (``hooked.py``); False: one
    failed and its policy answered."""
    hooks = exchange.hooks
    return hooks is None or not hooks.chooses or hooks.choose_server(exchange, failover)


def retry_or_fail(exchange: Routed, condition: str, reason: str) -> None:
    """The current try failed before anything reached the client: the next server, if
    ``next_upstream`` allows, else 504 (a timeout) or 502."""
    failover = exchange.failover
    assert failover is not None
    failover.failed(condition, reason)
    exchange.deadlines.end_attempt()
    exchange.release_upstream(close=True)
    if failover.allows(condition):
        _retry(exchange, failover, condition, reason)
    elif condition == "timeout":
        exchange.fail(504, "upstream timed out", reason)
    else:
        refuse(exchange, Reason.NO_SERVER, 502, "upstream unavailable", reason)


def _retry(exchange: Routed, failover: Failover, condition: str, reason: str) -> None:
    """The next try, which ``failover.allows``."""
    if not _chosen(exchange, failover):
        return  # an extension failed, and its policy answered
    failover.choose_room()  # its choice if that has room; ``allows`` found one that has
    failover.leave()
    failover.count_retry(condition, reason, exchange.request_id)
    exchange.move(_I.RETRY)
    failover.attempt()


def error_event_first(exchange: Routed, held: CommitPoint) -> None:
    """A held SSE response whose backend sent an error event before any content: a failure
    of its server, and the next server where ``next_upstream`` allows ``"error"``; else it
    stays held, and is relayed as the backend sent it."""
    error, held.error = held.error, None
    failover = exchange.failover
    if error is None or failover is None:
        return
    reason = f"error event {error} before the first token"
    failover.failed("error", reason)
    if failover.allows("error"):
        exchange.deadlines.end_attempt()
        exchange.release_upstream(close=True)
        _retry(exchange, failover, "error", reason)


def retry_stale(exchange: Routed, reason: str) -> bool:
    """The stale retry: a reused keep-alive connection failed before any response byte (RFC
    9112 §9.3.1). A fresh connection to the same server, if the request may go again
    (``Failover.allows_stale``), without touching the server's health or ``tries``. False:
    not taken."""
    failover = exchange.failover
    if failover is None or not failover.allows_stale(exchange.head, exchange.upstream):
        return False
    exchange.deadlines.end_attempt()
    exchange.release_upstream(close=True)
    exchange.move(_I.RETRY)
    failover.attempt_fresh(reason, exchange.request_id)
    return True


# -- the admission queue (``admit.py``) ---------------------------------------------------


def _waits_for_home(exchange: Routed, failover: Failover) -> bool:
    """Whether a keyed request waits for its home (its first candidate, full) before taking
    another server that has room (``admit.py``: up to ``queue.affinity_wait``)."""
    if failover.session_key is None and failover.prefix is None:
        return False
    hooks = exchange.hooks
    if hooks is not None and hooks.chooses:
        return False  # an extension chose its server: that choice stands
    admission, queue = exchange.admission, failover.group.queue
    if admission is None or not 0 < queue.affinity_wait < queue.wait_for(admission.priority):
        return False  # no wait, or one its deadline cuts short: it goes where there is room
    router, now, candidates = failover.router, exchange.fx.now, failover.candidates
    if all(router.has_room(index, now) for index in candidates):
        return False  # the common case, decided without hashing
    home = candidates[0]
    if failover.session_key is None and failover.prefix is not None:
        # The prefix's own first server, which the bounds put behind another while it is full.
        ranked = rendezvous_order(
            failover.prefix, router.ids, router.routing_weights(now), candidates
        )
        home = ranked[0] if ranked else home
    if router.has_room(home, now):
        return False
    # Every server full: the queue's own locality decides (``Admission.may_go``).
    if not any(router.has_room(index, now) for index in candidates if index != home):
        return False
    candidates.remove(home)
    candidates.insert(0, home)  # its home, for the queue (``_home``)
    return True


def _wait(exchange: Routed, *, for_home: bool = False) -> None:
    """Every candidate is full (``for_home``: its home is): wait in the group's queue, or
    429 when it is full."""
    admission, failover = exchange.admission, exchange.failover
    assert admission is not None and failover is not None
    home = _home(failover)
    if not admission.enqueue(failover.router, exchange, exchange.ident, home, for_home=for_home):
        _refuse_busy(exchange, Reason.QUEUE_FULL, "every server is busy and the queue is full")
        return
    exchange.move(_I.QUEUE)


def admitted(exchange: Routed) -> bool:
    """The queue admits ``exchange`` (a server has room): route it again, with the group as
    configured now, and try. True when it found no room after all: it waits again, at the
    back."""
    if not exchange.move(_I.ADMITTED):
        return False
    admission, failover = exchange.admission, exchange.failover
    assert admission is not None and failover is not None and exchange.group is not None
    left_queue(exchange, admission, failover)
    group = exchange.fx.config.upstreams.get(exchange.group.name)
    if group is None:
        text = "no backend available"
        refuse(exchange, Reason.NO_SERVER, 503, text, "the upstream group was removed")
        return False
    exchange.group = group
    failover.readmit(group)
    if not failover.candidates:
        refuse(exchange, Reason.NO_SERVER, 503, "no backend available")
        return False
    if not _chosen(exchange, failover):
        return False
    if not failover.choose_room():
        if admission.enqueue(failover.router, exchange, exchange.ident, _home(failover)):
            return True
        _refuse_busy(exchange, Reason.QUEUE_FULL, "every server is busy and the queue is full")
        return False
    exchange.move(_I.ATTEMPT)
    failover.attempt()
    return False


def _home(failover: Failover) -> str | None:
    """The server a keyed request belongs on (its first candidate); None: any."""
    if failover.session_key is None and failover.prefix is None:
        return None
    return failover.group.servers[failover.candidates[0]].address


def left_queue(exchange: Routed, admission: Admission, failover: Failover) -> None:
    """``exchange`` is out of the queue (admitted, or ended while it waited): its wait is
    measured."""
    waited = admission.leave_queue(failover.router, exchange, exchange.ident)
    if waited is not None:
        exchange.host.measurements.group(failover.group.name).queue_wait.observe(waited)


def queue_timeout(exchange: Routed) -> None:
    """The ``queue`` timer: its wait for its home ended (it may take any server with room
    now), or every server stayed busy for the deadline of the request's priority class
    (``queue.max_wait``, else ``queue.timeout``)."""
    admission, failover = exchange.admission, exchange.failover
    if admission is not None and failover is not None and admission.home_wait_over(exchange.ident):
        exchange.host.room_freed(failover.router)
        return
    _refuse_busy(exchange, Reason.QUEUE_TIMEOUT, "every server stayed busy for the queue's timeout")


def _refuse_busy(exchange: Routed, reason: Reason, text: str) -> None:
    """429: the queue is full or the wait ran out (``Retry-After: queue.retry_after``)."""
    assert exchange.group is not None
    retry = str(exchange.group.queue.retry_after).encode("ascii")
    refuse(exchange, reason, 429, text, extra=[(b"retry-after", retry)])


def _refuse_budget(exchange: Routed, refusal: Refusal) -> None:
    """429: the tenant's budget is spent (or the request can never fit in it): ``budget``
    when its tokens are short, ``rate_limited`` when only its request rate or its requests
    in flight are."""
    reason = Reason.BUDGET if refusal.tokens else Reason.RATE_LIMITED
    refuse(exchange, reason, 429, refusal.reason, extra=extra_fields(refusal))


def settle(
    exchange: Routed, admission: Admission, failover: Failover, answered: bool, events: int | None
) -> None:
    """The exchange ended: out of the queue if it waited, its reservation settled with what
    it used (``answered``: a response head came; ``events``: the SSE events it relayed, if it
    counted them)."""
    if admission.queued_at is not None:  # it ended while it waited
        left_queue(exchange, admission, failover)
    used = admission.settle(answered, events)
    if used is not None:
        stats = exchange.host.measurements.group(failover.group.name)
        stats.reservations -= 1
        stats.tokens_used += used
