"""Admission: one exchange's way past its group's budgets and through its queue.

What it obeys:

- The request's facts are read once, when it is routed (``routing/llmrequest.py``): the
  tokens it may generate (its ``max_tokens``, else the group's ``default_max_tokens``), its
  prefix key, its tenant and priority (``tenant``, ``priority``: any session-key source).
  The tenant is kept as a 64-bit blake2b of its value, never as sent: nothing here or in a
  log holds a credential. A header's value is read in its one spelling
  (``credentials.credential_key``: ``Bearer k``, ``bearer k`` and ``Bearer  k`` are one
  tenant, RFC 9110 §11.1), and a request that carries its tenant's header twice is refused
  with 400 (``repeated_tenant_field``): otherwise each spelling, or each choice of which
  field counts, would be a budget of its own.
- Budgets (``rate_limit``, ``routing/ratelimit.py``): on arrival the request reserves its
  expected tokens and one request from its tenant's buckets, before it waits or is sent, so
  requests in flight at once cannot spend more than the budget; a refusal is a 429 with
  ``Retry-After`` and the ``x-ratelimit-*`` fields (OpenAI's). When the exchange ends, the
  reservation is settled to the output tokens really used: the last ``usage`` the backend
  sent, in its API's field (``UsageScan``, ``core/apis/streaming.py``: ``completion_tokens``,
  or ``output_tokens`` for Responses and Messages), else the SSE tokens relayed (the
  events, or the API's token events), else (a response that is neither) what was reserved;
  nothing for a request that got no response from a backend. With a fleet store the
  reservation is the store's (``fleetadmit.py``, ``FleetHold``) and so is the settling: a
  ``BudgetSettle`` command the driver sends off the request's path.
- The queue (``queue``, ``routing/admission.py``): a request that finds no candidate with
  room waits, fair between tenants and strict between priorities, for at most its priority
  class's deadline (``queue.max_wait``, else ``queue.timeout``); past ``queue.max`` waiting,
  or past its deadline, it is answered 429 with ``Retry-After: queue.retry_after``
  (``refusal.py``: ``queue_full``, ``queue_timeout``). A deadline is the class's own
  (a class-9 request may give up after its 2 s while a class-0 one still waits); the order
  of service does not change. Its wait is measured.
- Waiting for home: a keyed request (a session key or a prefix) whose first candidate is
  full while another has room waits in the queue for that server first, up to
  ``queue.affinity_wait`` (``home_until``): its prefix is cached there, and a slot there
  often frees sooner than another server computes the prefix cold. Until then only a slot on
  its home admits it (``may_go``) and no other slot is handed to it (``held_for_home``); at
  ``home_until`` its ``queue`` timer fires first, and it takes the first server with room.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from muxproxy.config import AffinityMode, SessionSource, Upstream
from muxproxy.config.queue import PRIORITIES
from muxproxy.core.apis.streaming import OPENAI_LIKE, ApiStream, stream_for
from muxproxy.core.commands import BudgetSettle
from muxproxy.core.effects import Effects
from muxproxy.core.http.credentials import credential_key, repeated_field
from muxproxy.core.messages import Headers, RequestHead
from muxproxy.core.timers import ExchangeTimer
from muxproxy.fleet.budgets import Ask
from muxproxy.routing.kvtokens import conversation_keys
from muxproxy.routing.llmrequest import NOTHING, LlmRequest, read_request
from muxproxy.routing.load import Progress, Ticket
from muxproxy.routing.ratelimit import RateLimiter, Refusal, Reservation
from muxproxy.routing.sticky import source_value

if TYPE_CHECKING:
    from muxproxy.core.observe.series import GroupStats
    from muxproxy.routing.admission import FairQueue
    from muxproxy.routing.router import GroupRouter


def tenant_of(value: bytes | None) -> int:
    """The tenant a source value names, as a stable 64-bit hash (0: no tenant)."""
    if not value:
        return 0
    return int.from_bytes(hashlib.blake2b(value, digest_size=8, person=b"mux-tenant").digest())


def priority_of(value: bytes | None) -> int:
    """A priority class from a source value: an integer clamped to 0..9; else 0."""
    if value is None:
        return 0
    try:
        level = int(value.strip() or b"x")
    except ValueError:
        return 0
    return min(max(level, 0), PRIORITIES - 1)


@attrs.define
class FleetHold:
    """A reservation asked of the fleet store (``fleetadmit.py``)."""

    store: str
    ask: Ask
    key: bytes | None
    """The request's session key, to route with once the store answers."""
    reserved: bool = False
    """The store took it: settle it at the end."""


class Admission:
    """The facts, reservation and queue wait of one exchange in one group."""

    __slots__ = (
        "conversation",
        "deadline",
        "facts",
        "fleet",
        "fx",
        "group",
        "home",
        "home_until",
        "limiter",
        "priority",
        "queued_at",
        "reservation",
        "target",
        "tenant",
        "ticket",
        "tokenize",
        "usage",
    )

    def __init__(
        self, fx: Effects, group: Upstream, head: RequestHead, document: object | None
    ) -> None:
        """``document``: the parsed request body, None when it was not read."""
        self.fx = fx
        self.group = group
        facts = NOTHING
        if document is not None:
            length = group.prefix.length if group.affinity is AffinityMode.PREFIX else 0
            facts = read_request(document, source=group.prefix.source, length=length)
        self.facts: LlmRequest = facts
        self.tenant = tenant_of(_tenant_value(group.tenant, head, document))
        self.priority = priority_of(_value(group.priority, head, document))
        self.ticket = Ticket(facts.max_tokens or group.default_max_tokens)
        """The request's expected work on the server it runs on (``routing/load.py``)."""
        self.reservation: Reservation | None = None
        self.limiter: RateLimiter | None = None
        """The budgets the reservation was taken from (they outlive a reload that keeps
        ``rate_limit``)."""
        self.usage: UsageScan | None = None
        self.target = head.target
        """Which API the response speaks, for ``scan_usage``."""
        self.fleet: FleetHold | None = None
        """With a fleet store: the reservation asked of it, then held."""
        self.queued_at: float | None = None
        self.deadline = 0.0
        """While queued: when its class's wait runs out."""
        self.home_until: float | None = None
        """While it waits for its home alone (see the module header): until when."""
        self.home: str | None = None
        """While queued: the address of the server this request belongs on (its session
        key's or prefix's first candidate), None for one that may go anywhere."""
        self.conversation: list[bytes] | None = None
        """With ``kv_events``: the keys of its message prefixes (``kvtokens.py``), which
        the engines' caches are scored by; None otherwise."""
        self.tokenize: dict[str, Any] | None = None
        """With a conversation: its body, whose prompt the engine is asked to tokenize once
        it is placed (the ``/tokenize`` body is written only if asked)."""
        if group.kv_events is not None and isinstance(document, dict):
            self.conversation = conversation_keys(document) or None
            if self.conversation is not None:
                self.tokenize = document

    def streaming(self, progress: Progress) -> None:
        """The response streams: its work left shrinks as ``progress`` counts its events."""
        self.ticket.progress = progress

    @property
    def prefix_key(self) -> bytes | None:
        return self.facts.prefix_key

    # -- budgets ---------------------------------------------------------------------------

    def reserve(self, router: GroupRouter) -> Refusal | None:
        """Take this request's share of its tenant's budgets; the refusal if they are spent."""
        limiter = router.limiter
        if limiter is None:
            return None
        result = limiter.reserve(self.tenant, self.ticket.expected, self.fx.now)
        if isinstance(result, Refusal):
            return result
        self.reservation = result
        self.limiter = limiter
        if router.group.rate_limit is not None and router.group.rate_limit.tokens_per_minute:
            self.scan_usage()
        return None

    def scan_usage(self) -> None:
        """Read the response's usage, in its API's fields (chat's for a path of no known API),
        to settle a token budget with."""
        self.usage = UsageScan(stream_for(self.target) or OPENAI_LIKE)

    def count(self, stats: GroupStats) -> None:
        """Count the reservation taken (local or the store's) in its group's ``stats``."""
        reserved = self.reserved
        if reserved is not None:
            stats.reservations += 1
            stats.tokens_reserved += reserved

    @property
    def reserved(self) -> int | None:
        """The tokens reserved, local or in the store; None: nothing is held."""
        if self.reservation is not None:
            return self.reservation.tokens
        held = self.fleet
        return held.ask.tokens if held is not None and held.reserved else None

    def settle(self, answered: bool, events: int | None) -> int | None:
        """Correct the reservation to what was used (see the module header): ``answered``,
        whether a backend's response came; ``events``: the SSE events relayed, if SSE.
        The tokens counted as used; None when nothing was reserved."""
        reserved = self.reserved
        if reserved is None:
            return None
        reservation, limiter, held = self.reservation, self.limiter, self.fleet
        self.reservation = self.fleet = None
        if not answered:
            used = 0
        elif self.usage is not None and self.usage.output_tokens is not None:
            used = self.usage.output_tokens
        elif events is not None:
            used = events
        else:
            used = reserved
        if reservation is not None and limiter is not None:
            limiter.settle(reservation, used, self.fx.now)
        if held is not None and held.reserved:
            correction = reserved - min(max(used, 0), 2**63 - 1)
            ask = held.ask
            if ask.leased or (ask.budget.tokens_per_minute is not None and correction):
                self.fx.emit(BudgetSettle(store=held.store, ask=ask, correction=correction))
        return used

    # -- the queue -------------------------------------------------------------------------

    def enqueue(
        self,
        router: GroupRouter,
        exchange: object,
        ident: int,
        home: str | None,
        *,
        for_home: bool = False,
    ) -> bool:
        """Wait in ``router``'s queue, for a slot on ``home`` preferably (``for_home``: on
        ``home`` alone, for ``queue.affinity_wait``); False when the queue is full."""
        if not router.queue.push(exchange, self.tenant, self.priority):
            return False
        self.home = home
        fx = self.fx
        self.queued_at = fx.now
        self.deadline = fx.now + self.group.queue.wait_for(self.priority)  # its ``max_wait``
        until = fx.now + self.group.queue.affinity_wait if for_home and home else None
        self.home_until = until if until is not None and until < self.deadline else None
        at = self.deadline if self.home_until is None else self.home_until
        fx.set_timer((ExchangeTimer.QUEUE, ident), at)
        return True

    def home_wait_over(self, ident: int) -> bool:
        """The ``queue`` timer fired: True when it ended the wait for home (not its
        deadline); its deadline's timer is set again."""
        if self.home_until is None:
            return False
        self.home_until = None
        self.fx.set_timer((ExchangeTimer.QUEUE, ident), self.deadline)
        return True

    def held_for_home(self, now: float) -> bool:
        """Whether it still waits for its home alone (no other server's slot is its)."""
        return self.home_until is not None and now < self.home_until

    def may_go(self, rooms: set[str], now: float) -> bool:
        """Whether a slot on one of ``rooms`` (addresses) may be this request's now: it has no
        home, its home is one of them, or it waited ``queue.affinity_wait`` already (and no
        longer waits for its home alone)."""
        home, at = self.home, self.queued_at
        if home is None or home in rooms or at is None:
            return True
        if self.home_until is not None:
            return now >= self.home_until
        return now - at >= self.group.queue.affinity_wait

    def leave_queue(self, router: GroupRouter, exchange: object, ident: int) -> float | None:
        """No longer waiting (admitted, timed out, gone): the seconds it waited, if it did."""
        at = self.queued_at
        if at is None:
            return None
        self.queued_at = self.home_until = None
        router.queue.remove(exchange)
        self.fx.cancel_timer((ExchangeTimer.QUEUE, ident))
        return self.fx.now - at


def next_to_admit(
    queue: FairQueue[object],
    rooms: set[str],
    now: float,
    admission_of: Callable[[object], Admission | None],
    lookahead: int,
) -> object | None:
    """The next waiting request a slot on ``rooms`` goes to, taken out of ``queue``: of the
    next ``lookahead`` in fair order, the first whose home is in ``rooms`` or that may go
    anywhere (``Admission.may_go``), else the fairest that does not wait for its home alone
    (``Admission.held_for_home``: no slot stays idle for locality beyond that); None when
    every one of them waits for its home alone."""

    def may_go(item: object) -> bool:
        admission = admission_of(item)
        return admission is None or admission.may_go(rooms, now)

    def takes_any(item: object) -> bool:
        admission = admission_of(item)
        return admission is None or not admission.held_for_home(now)

    return queue.pop_first(may_go, lookahead) or queue.pop_first(takes_any, lookahead)


def _value(
    source: SessionSource | None, head: RequestHead, document: object | None
) -> bytes | None:
    if source is None:
        return None
    return source_value(source, head.headers, head.target, document)


def _tenant_value(
    source: SessionSource | None, head: RequestHead, document: object | None
) -> bytes | None:
    value = _value(source, head, document)
    if value is not None and source is not None and source.kind == "header":
        value = credential_key(source.name.encode("latin-1"), value)
    return value


def repeated_tenant_field(group: Upstream, head: RequestHead) -> str | None:
    """The 400 answer's text when ``head`` carries the header that names its tenant in
    ``group`` more than once (RFC 9110 §5.3; see the module header); None otherwise."""
    source = group.tenant
    if source is None or source.kind != "header":
        return None
    if repeated_field(head.headers, source.name.encode("latin-1")):
        return f"more than one {source.name} field"
    return None


_TAIL = 64
"""Bytes of a chunk kept for the next one: a field split between two chunks is still seen."""


class UsageScan:
    """The last output and input token counts in a response body, in its API's fields
    (OpenAI's ``"completion_tokens": N``, Responses' and Messages' ``"output_tokens": N``, in a
    JSON response or the stream's last events), found chunk by chunk in bounded memory."""

    __slots__ = ("input_tokens", "output_tokens", "patterns", "tail")

    def __init__(self, api: ApiStream = OPENAI_LIKE) -> None:
        self.patterns = (api.output_usage, api.input_usage)
        self.output_tokens: int | None = None
        self.input_tokens: int | None = None
        self.tail = b""

    def feed(self, data: bytes) -> None:
        text = self.tail + data
        output, input = self.patterns
        found = _last(output, text)
        if found is not None:
            self.output_tokens = found
        found = _last(input, text)
        if found is not None:
            self.input_tokens = found
        self.tail = text[-_TAIL:]


def _last(pattern: re.Pattern[bytes], text: bytes) -> int | None:
    """The last complete count ``pattern`` finds in ``text`` (digits with something after)."""
    found = None
    for match in pattern.finditer(text):
        found = match
    return int(found[1]) if found is not None and found.end() < len(text) else None


def extra_fields(refusal: Refusal) -> Headers:
    """The fields of a 429 for a budget: ``Retry-After`` (RFC 9110 §10.2.3, whole seconds,
    rounded up) unless the request can never fit, and the ``x-ratelimit-*`` fields."""
    fields = list(refusal.headers)
    if not refusal.too_large:
        seconds = max(1, -int(-refusal.retry_after // 1))
        fields.insert(0, (b"retry-after", str(seconds).encode("ascii")))
    return fields
