"""Load-aware choices: outstanding work per server, the engines' own reports, power of two
choices, and consistent hashing with bounded loads.

Obeys the routing rules: pure code, standard library and attrs only, no clock (``now`` is
passed in), no I/O. The "random" choices come from a seeded splitmix64 sequence
(``Sampler``): deterministic for a given seed and sequence of calls, so tests need no mocks,
while one proxy's picks are spread as random ones would be.

Outstanding work (``balance = "least_load"``). Each stream on a server holds a ``Ticket``:
the tokens it is expected to generate (its ``max_tokens``, or the group's default) and its
progress (the SSE meter that counts the events relayed). A server's own work is the sum over
its tickets of what is left, ``max(expected - events, 0)``, computed when a choice is made:
the per-token path does no accounting at all, and the sum is exact whenever it is read. A
fresh report from the engine (``loadreport.py``; fresh: at most 3 intervals old) adds the
work the proxy does not see: the requests waiting in the engine's queue and those it runs
for others (reported running beyond our own streams there), each at the default.

Power of two choices (Mitzenmacher 2001): two distinct servers are drawn with probability in
proportion to their weights, and the one with less work per weight wins (the first drawn on
a tie). Against a full scan it avoids herding on a stale report, and it costs two sums.

Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): a key's
servers are ranked by weighted rendezvous hashing (``balancer.rendezvous_order``), and the
first one whose streams would stay within ``ceil(c x (total + 1) x weight / total weight)``
takes it; the others follow as fallbacks. With ``c >= 1`` some server always has room, a
hot key spills to its second server instead of melting its first, and a key moves only when
its server is over the bound. The bound is relative to the mean, so near a fleet's capacity
it lets a hot key's server run a queue while another has free slots; ``gap``
(``prefix.balance_gap``) adds an absolute one, as SGLang's router switches to the shortest
queue past ``balance_abs_threshold``: a server also stays within ``gap`` streams (per unit of
weight) of the least loaded server, counting the new one. With ``gap >= 1`` the least loaded
server is always within both bounds.

Free slots come first (``free``): a key whose first server has a free batch slot goes there,
whatever the bounds say; both bounds count streams, and near the mean they would move a key
off an engine that could start it at once onto another that computes its prefix cold. A
server's slots are its ``max_streams``, else what its engine showed when it last queued (the
``running`` of a fresh report with requests ``waiting``: its batch was full); it has a free
slot while its streams, and the running of a fresh report, are below them and the report
shows no queue (``ServerLoads.free``). Before its slots are seen, a fresh report without a
queue says it has room, for up to ``UNSEEN_SPARE`` streams sent after that report (the next
one confirms). A key whose first server is full goes to the first server in its order
within the bounds that is not full (else the first within the bounds: every server is full,
and the gap keeps the lead bounded). Unknown room (no slots, no fresh report) counts as not
full: the bounds alone decide.

The gap when ``balance_gap`` is unset (``default_gap``): a quarter of the smallest known
server's slots, rounded up (vLLM's batch of 256 gives 64, SGLang's router's default
``balance_abs_threshold``; 8 slots give 2), and ``DEFAULT_GAP`` while no slots are known.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from muxproxy.routing.balancer import rendezvous_order
from muxproxy.routing.loadreport import LoadReport

__all__ = [
    "DEFAULT_GAP",
    "REPORT_LIFETIMES",
    "Sampler",
    "ServerLoads",
    "Ticket",
    "bounded_order",
    "default_gap",
    "power_of_two",
    "within_bounds",
]

REPORT_LIFETIMES = 3
"""A report older than this many poll intervals is ignored."""

DEFAULT_GAP = 4
"""``balance_gap`` while no server's slots are known: half an 8-slot engine's batch, so a hot
key's server runs at most a few streams ahead of the least loaded one; small enough never to
let one engine queue long while another idles."""


UNSEEN_SPARE = 4
"""With a server's slots unknown, how many streams the proxy may send it after a report that
showed no queue before the next report must confirm there is still room."""


class Progress(Protocol):
    """What a ticket reads of its stream: the SSE events relayed so far."""

    @property
    def events(self) -> int: ...


class Ticket:
    """One stream's expected work on its server."""

    __slots__ = ("expected", "progress")

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.progress: Progress | None = None
        """Set once the response is an SSE stream (its meter); None: nothing relayed yet."""

    @property
    def remaining(self) -> int:
        progress = self.progress
        if progress is None:
            return self.expected
        return max(self.expected - progress.events, 0)


class ServerLoads:
    """Per server of a group: the tickets of its streams and the engine's last report."""

    __slots__ = ("default_tokens", "interval", "reports", "seen_slots", "sent_at_report", "tickets")

    def __init__(self, size: int, default_tokens: int, interval: float | None) -> None:
        self.default_tokens = default_tokens
        self.interval = interval
        """The poll interval of the group's load reports; None: no reports."""
        self.tickets: list[dict[Ticket, None]] = [{} for _ in range(size)]
        self.reports: list[tuple[LoadReport, float] | None] = [None] * size
        self.seen_slots: list[int | None] = [None] * size
        """Per server, the most requests its engine ran while it queued others (its batch
        slots, as seen); None: never seen queueing."""
        self.sent_at_report: list[int] = [0] * size
        """Per server, the proxy's own streams on it when its last report came."""

    def carry(self, old: ServerLoads, moves: Iterable[tuple[int, int]]) -> None:
        """Take over ``old``'s tickets, reports and slots seen of the servers ``moves`` maps
        here."""
        for before, after in moves:
            self.tickets[after] = old.tickets[before]
            self.reports[after] = old.reports[before]
            self.seen_slots[after] = old.seen_slots[before]
            self.sent_at_report[after] = old.sent_at_report[before]

    def add(self, index: int, ticket: Ticket) -> None:
        self.tickets[index][ticket] = None

    def remove(self, index: int, ticket: Ticket) -> None:
        self.tickets[index].pop(ticket, None)

    def own_work(self, index: int) -> int:
        """Tokens our streams on ``index`` are still expected to generate."""
        return sum(ticket.remaining for ticket in self.tickets[index])

    def report(self, index: int, report: LoadReport, now: float, streams: int = 0) -> None:
        """The engine's report on ``index``, with the proxy's own ``streams`` there now."""
        self.reports[index] = (report, now)
        self.sent_at_report[index] = streams
        running = report.running
        if report.waiting and running:  # a queue behind a full batch: its size is seen
            seen = self.seen_slots[index]
            self.seen_slots[index] = running if seen is None else max(seen, running)

    def slots(self, index: int, max_streams: int | None) -> int | None:
        """The server's batch slots: its ``max_streams``, else as seen; None: unknown."""
        return max_streams if max_streams is not None else self.seen_slots[index]

    def free(self, index: int, streams: int, max_streams: int | None, now: float) -> bool | None:
        """Whether the server has a free slot (see the module header): its ``streams`` and
        the running of a fresh report below its slots, and no queue reported; with its slots
        unknown, a fresh report without a queue and fewer than ``UNSEEN_SPARE`` streams sent
        since; None: unknown (no slots and no fresh report, or that many sent since)."""
        slots = max_streams if max_streams is not None else self.seen_slots[index]
        report = self.fresh(index, now)
        if slots is None:
            if report is None or report.waiting is None:
                return None
            if report.waiting:
                return False
            return True if streams - self.sent_at_report[index] < UNSEEN_SPARE else None
        if report is not None:
            if report.waiting:
                return False
            if report.running is not None and report.running > streams:
                streams = report.running
        return streams < slots

    def fresh(self, index: int, now: float) -> LoadReport | None:
        """The server's report, if at most ``REPORT_LIFETIMES`` intervals old."""
        entry = self.reports[index]
        if entry is None or self.interval is None:
            return None
        report, at = entry
        if now - at > REPORT_LIFETIMES * self.interval:
            return None
        return report

    def work(self, index: int, own_streams: int, now: float) -> int:
        """Outstanding work on ``index``: our own, plus what a fresh report adds."""
        work = self.own_work(index)
        report = self.fresh(index, now)
        if report is not None:
            foreign = report.waiting or 0
            if report.running is not None:
                foreign += max(report.running - own_streams, 0)
            work += foreign * self.default_tokens
        return work

    def kv_full(self, index: int, limit: float, now: float) -> bool:
        """Whether a fresh report has the server's KV cache above ``limit``."""
        report = self.fresh(index, now)
        return report is not None and report.kv_cache is not None and report.kv_cache > limit

    def waiting(self, index: int, now: float) -> int | None:
        """Requests the engine reports waiting (fresh reports only)."""
        report = self.fresh(index, now)
        return None if report is None else report.waiting


_MASK = (1 << 64) - 1


class Sampler:
    """splitmix64 (Steele, Lea, Flood 2014): a 64-bit sequence from a seed, pure."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = z = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, bound: int) -> int:
        """An integer in ``[0, bound)`` (bound >= 1), with a bias below 2**-40."""
        return (self.next() >> 24) % bound


def _draw(weights: Sequence[int], among: Sequence[int], sampler: Sampler) -> int:
    """A position in ``among`` drawn with probability in proportion to its weight."""
    total = sum(weights[i] for i in among)
    point = sampler.below(total)
    for at, index in enumerate(among):
        point -= weights[index]
        if point < 0:
            return at
    return len(among) - 1  # unreachable: the points sum to ``total``


def power_of_two(
    weights: Sequence[int],
    work: Callable[[int], int],
    eligible: Iterable[int],
    sampler: Sampler,
) -> int | None:
    """The less loaded (per weight) of two servers drawn by weight; None if none eligible.

    ``work(i)`` is asked only for the two drawn servers. Servers with weight <= 0 are never
    drawn.
    """
    among = [index for index in eligible if weights[index] > 0]
    if not among:
        return None
    if len(among) == 1:
        return among[0]
    first = among.pop(_draw(weights, among, sampler))
    second = among[_draw(weights, among, sampler)]
    # work_first / weight_first <= work_second / weight_second, without floats
    if work(first) * weights[second] <= work(second) * weights[first]:
        return first
    return second


def within_bounds(
    weights: Sequence[int],
    streams: Sequence[int],
    among: Sequence[int],
    factor: float,
    gap: int | None = None,
) -> Callable[[int], bool]:
    """Whether a server of ``among`` may take one more stream within the bounded-loads bound
    (``factor``) and, with ``gap``, the bounded lead over the least loaded server of
    ``among`` (see the module header). ``among``'s servers have weights above 0."""
    total_weight = sum(weights[i] for i in among)
    total = sum(streams[i] for i in among) + 1  # this request included
    low = among[0] if among else 0
    if gap is not None:
        for index in among:  # the least loaded per weight, without floats
            if streams[index] * weights[low] < streams[low] * weights[index]:
                low = index

    def within(index: int) -> bool:
        bound = math.ceil(factor * total * weights[index] / total_weight)
        if streams[index] + 1 > bound:
            return False
        # (streams + 1) / weight <= streams_low / weight_low + gap / weight, without floats
        return gap is None or (streams[index] + 1 - gap) * weights[low] <= (
            streams[low] * weights[index]
        )

    return within


def default_gap(slots: Iterable[int | None]) -> int:
    """``balance_gap`` when it is unset: a quarter of the smallest of ``slots`` (the servers'
    batch slots, None where unknown), rounded up; ``DEFAULT_GAP`` when none is known."""
    known = [count for count in slots if count is not None]
    return max(1, -(-min(known) // 4)) if known else DEFAULT_GAP


def bounded_order(
    key: bytes,
    ids: Sequence[bytes],
    weights: Sequence[int],
    streams: Sequence[int],
    eligible: Iterable[int],
    factor: float,
    gap: int | None = None,
    free: Callable[[int], bool | None] | None = None,
) -> list[int]:
    """The servers for ``key``: rendezvous order, with the first server within its bounds
    moved to the front (consistent hashing with bounded loads, and with ``gap``, bounded
    lead over the least loaded server; see the module header). With ``free`` (whether a
    server has a free slot; None: unknown), a first server with a free slot stays first,
    and a full one gives way to the first within the bounds that is not full."""
    order = rendezvous_order(key, ids, weights, eligible)
    if len(order) < 2:
        return order
    if free is not None and free(order[0]):
        return order  # its home can start it now: never spilled
    within = within_bounds(weights, streams, order, factor, gap)
    first = None
    for at, index in enumerate(order):
        if within(index):
            if free is None or free(index) is not False:
                first = at
                break
            if first is None:
                first = at  # every server within the bounds may be full
    if first:
        order.insert(0, order.pop(first))
    return order  # none within: unreachable for factor >= 1 and gap >= 1
