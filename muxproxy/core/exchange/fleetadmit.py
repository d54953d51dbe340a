"""Admission against the fleet's budgets: an exchange waits for the store's reservation.

What it obeys, and why:

- **One round trip, before anything else.** With ``[fleet] store`` a group's ``rate_limit``
  is the fleet's (``fleet/budgets.py``): on routing, the exchange asks the store for its
  reservation (``BudgetReserve``: its expected tokens, one request, one concurrency lease
  with ``max_concurrent``, in one script) and waits in ``Phase.RESERVING`` for the answer
  (``BudgetAnswered``); then it is placed, queued or refused as without a store. The core
  never waits itself: the driver runs the script and feeds the answer, as it does for the
  resume store's fetch. No other store trip is on a request's path: the settle at the end
  is a ``BudgetSettle`` the driver batches (``admit.Admission.settle``).
- **A bounded wait.** The driver answers within ``fleet.budgets.RESERVE_TIMEOUT`` seconds,
  an error when the store is down, slow or answers what no script returns; a client that
  leaves meanwhile ends the exchange (the table takes its abort in RESERVING), and an answer
  that finds it ended gives back what the store took (``give_back``).
- **Store errors follow ``on_store_error``.** ``local`` (the default): the replica enforces
  its share of each budget (``Budget.share`` of the replicas the driver last saw), with the
  router's own limiter; ``open``: admitted with no budget; ``closed``: 503, with the reason.
  Each answer is counted by outcome (``reserved``, ``refused``, ``error``).

Pure: the store's I/O is the driver's (``trio/fleetbudgets.py``); the clock is ``fx.now``.
"""

from __future__ import annotations

from muxproxy.config import StoreErrorPolicy, Upstream
from muxproxy.core.commands import BudgetReserve, BudgetSettle
from muxproxy.core.effects import Effects
from muxproxy.core.events import BudgetAnswered
from muxproxy.core.exchange.admit import Admission, FleetHold
from muxproxy.core.observe.measure import Measurements
from muxproxy.fleet.budgets import Ask, refusal_of
from muxproxy.routing.ratelimit import Budget, RateLimiter, Refusal
from muxproxy.routing.router import GroupRouter

__all__ = ["ask_store", "budget_of", "decide", "give_back"]


def budget_of(group: Upstream) -> Budget | None:
    """The group's ``rate_limit`` as a ``Budget``; None without one."""
    limit = group.rate_limit
    if limit is None:
        return None
    return Budget(
        tokens_per_minute=limit.tokens_per_minute,
        requests_per_minute=limit.requests_per_minute,
        max_concurrent=limit.max_concurrent,
    )


def ask_store(
    fx: Effects, group: Upstream, admission: Admission, ident: int, key: bytes | None
) -> bool:
    """With a fleet store and budgets in ``group``: ask the store for the reservation of
    exchange ``ident`` (``BudgetReserve``) and hold what the answer needs. False: the
    budgets are this process's (no fleet, or no budget): reserve locally."""
    fleet = fx.config.fleet
    budget = budget_of(group)
    if fleet is None or budget is None:
        return False
    ask = Ask(
        request=ident,
        group=group.name,
        tenant=admission.tenant,
        budget=budget,
        tokens=min(max(admission.ticket.expected, 0), 2**63 - 1),
    )
    admission.fleet = FleetHold(store=fleet.store, ask=ask, key=key)
    fx.emit(BudgetReserve(store=fleet.store, ask=ask))
    return True


def decide(
    fx: Effects,
    router: GroupRouter,
    measurements: Measurements,
    admission: Admission,
    event: BudgetAnswered,
) -> Refusal | str | None:
    """What the store's answer means for the exchange waiting on it: None, admitted (the
    reservation held, the store's or the local share's); a ``Refusal`` (429); a reason
    (503: the store failed and ``on_store_error`` is ``closed``)."""
    held = admission.fleet
    assert held is not None
    ask = held.ask
    verdict = event.verdict
    if verdict is not None:
        if not verdict.reserved:
            measurements.fleet_budget("refused")
            return refusal_of(verdict, ask.budget, ask.tokens)
        measurements.fleet_budget("reserved")
        held.reserved = True
        _scan_usage(admission, ask.budget)
        return None
    measurements.fleet_budget("error")
    fleet = fx.config.fleet
    policy = fleet.on_store_error if fleet is not None else StoreErrorPolicy.LOCAL
    match policy:
        case StoreErrorPolicy.OPEN:
            return None
        case StoreErrorPolicy.CLOSED:
            return f"rate limit store unavailable ({event.error})"
        case StoreErrorPolicy.LOCAL:
            limiter = _share(router, ask.budget, event.replicas)
            result = limiter.reserve(ask.tenant, ask.tokens, fx.now)
            if isinstance(result, Refusal):
                return result
            admission.reservation = result
            admission.limiter = limiter
            _scan_usage(admission, ask.budget)
            return None


def give_back(fx: Effects, event: BudgetAnswered) -> None:
    """The exchange ended before the store answered: what the store reserved for it goes
    back (its tokens and its lease; the request stays counted, as one that was answered)."""
    verdict = event.verdict
    if verdict is None or not verdict.reserved:
        return
    fx.emit(BudgetSettle(store=event.store, ask=event.ask, correction=event.ask.tokens))


def _scan_usage(admission: Admission, budget: Budget) -> None:
    if budget.tokens_per_minute is not None:
        admission.scan_usage()


def _share(router: GroupRouter, budget: Budget, replicas: int) -> RateLimiter:
    """The limiter of this replica's share of ``budget`` (``on_store_error = "local"``),
    made again when the share changes (another replica count, a reload)."""
    share = budget.share(replicas)
    limiter = router.share
    if limiter is None or limiter.budget != share:
        limiter = router.share = RateLimiter(share)
    return limiter
