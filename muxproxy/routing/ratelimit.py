"""Per-tenant budgets of tokens and requests per minute, as OpenAI's API enforces them.

Obeys the routing rules: pure code, standard library and attrs only, no clock (``now`` is
passed in, seconds on a monotonic clock), no randomness, no I/O; nothing a client or a backend
sends (token counts, usage figures) makes it raise. Why it exists: a tenant that sends too
much should get a 429 with the headers OpenAI's clients already read, before it takes a
server's time from the others.

Theory of operation: a token bucket per tenant and budget. A bucket holds at most its
per-minute amount (its capacity) and refills continuously at capacity / 60 per second; a new
tenant starts full. ``reserve`` takes one request and the request's estimated tokens at
once, or nothing: a request never holds half a reservation. ``settle`` corrects the estimate
to the real usage once the response is done: the tokens not used go back (never above
capacity), tokens used beyond the estimate are charged, which may take the level below 0:
the tenant then waits until it has paid the debt off. Concurrent requests cannot overspend:
each reservation is taken from what is there when it is made, so over any window that ends
with a reservation, the tokens taken (reservations plus corrections) are at most capacity
plus the refill over the window (the invariant ``tests/routing/test_ratelimit.py`` checks).
``max_concurrent`` is a count, not a bucket: a reservation holds one of the tenant's slots
until it is settled.

With a fleet store the same budgets hold fleet-wide (``fleet/budgets.py``, the same rules in
Lua in Redis); this limiter is then the fallback while the store cannot be reached, made with
``Budget.share`` of the replicas last seen.

Invariants:

- Bounded memory: a bucket that has refilled to full is the same as no bucket, so none is
  kept; at most ``limit`` tenants are held, the least recently seen dropped first. Full
  buckets are dropped from the old end a few per call, so no call does unbounded work
  (amortised O(1); an ``OrderedDict``, whose oldest entry is found in O(1) however many were
  deleted before it, unlike a plain dict's).
- A debt is at most one capacity (the level never goes below -capacity): a bogus usage
  figure from a backend can lock a tenant out for two minutes at most, not for ever.
- Tenants are the caller's integer hashes of its key: no tenant identifier is held.
- In-flight counts are held only while above 0: at most one entry per reservation held.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import attrs

__all__ = [
    "DEFAULT_LIMIT",
    "Budget",
    "RateLimiter",
    "Refusal",
    "Reservation",
    "budget_headers",
    "format_duration",
]

DEFAULT_LIMIT = 100_000
"""Tenants held at most: a held tenant costs about 250 bytes (its int key, a bucket of three
floats, its ordered-dict node; measured with tracemalloc), so 25 MB at most."""

_SWEEP = 8
"""Full buckets dropped per call at most: amortised O(1), never a long pause."""

_MAX_COUNT = 2**63 - 1
"""Token counts above this count as this: a client's or backend's absurd number must neither
overflow a float nor an int's string form (ValueError past 4,300 digits)."""

_MIN_RETRY = 0.001
"""The shortest retry_after: a deficit of a rounding error still means "not yet"."""

CONCURRENCY_RETRY = 1.0
"""The retry_after of a refusal for ``max_concurrent``: no refill says when a slot frees; a
second is about one short answer's time, and ``Retry-After`` counts whole seconds."""

Headers = tuple[tuple[bytes, bytes], ...]


def _positive_or_none(_: object, attribute: attrs.Attribute[int | None], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive integer or None, not {value!r}")


@attrs.frozen(kw_only=True)
class Budget:
    """What each tenant may spend per minute; None is no limit of that kind."""

    tokens_per_minute: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Tokens (prompt and completion) per minute: the bucket's capacity."""
    requests_per_minute: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Requests per minute."""
    max_concurrent: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Requests in flight at once (reserved, not yet settled)."""

    def share(self, parts: int) -> Budget:
        """This budget split ``parts`` ways (each limit rounded up, at least 1): what one of
        ``parts`` replicas enforces alone while they cannot share the fleet's count."""
        parts = max(parts, 1)

        def part(limit: int | None) -> int | None:
            return None if limit is None else max(1, -(-limit // parts))

        return Budget(
            tokens_per_minute=part(self.tokens_per_minute),
            requests_per_minute=part(self.requests_per_minute),
            max_concurrent=part(self.max_concurrent),
        )


@attrs.frozen(kw_only=True)
class Reservation:
    """A request let through; hand it to ``settle`` when its real usage is known."""

    tenant: int
    tokens: int
    """The tokens reserved (the request's estimate, at least 0)."""
    leased: bool = False
    """It holds one of the tenant's ``max_concurrent`` slots (``settle`` frees it)."""


@attrs.frozen(kw_only=True)
class Refusal:
    """A request not let through; nothing was taken."""

    retry_after: float
    """Seconds until enough will have refilled (> 0), or 0 with ``too_large``."""
    reason: str
    """Which limit, for a log line or the error body."""
    headers: Headers
    """The tenant's ``x-ratelimit-*`` headers; the caller adds Retry-After."""
    too_large: bool
    """The request's tokens exceed the whole per-minute budget: no wait makes it fit."""
    tokens: bool
    """The token budget is short (or ``too_large``): a ``budget`` refusal; False: only the
    request rate or the requests in flight are (``rate_limited``)."""


def format_duration(seconds: float) -> bytes:
    """A ``x-ratelimit-reset-*`` value: Go's ``time.Duration`` format, as OpenAI sends it.

    Rounded up to whole milliseconds (the bucket is full by then, never later): ``0s``,
    ``20ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h2m3.004s``. Negative durations are ``0s``.
    """
    # round() first: 0.02 * 1000 is 20.000000000000004, which must not become 21 ms.
    millis = max(0, math.ceil(round(seconds * 1000, 6)))
    if millis < 1000:
        return b"0s" if millis == 0 else b"%dms" % millis
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    text = b"%d" % whole
    if fraction:
        text += b".%s" % (b"%03d" % fraction).rstrip(b"0")
    if hours:
        return b"%dh%dm%ss" % (hours, minutes, text)
    if minutes:
        return b"%dm%ss" % (minutes, text)
    return text + b"s"


@attrs.define
class _Bucket:
    tokens: float
    requests: float
    updated: float


class RateLimiter:
    """Token buckets per tenant for one ``Budget``; see the module's theory of operation."""

    __slots__ = ("_buckets", "_in_flight", "budget", "limit")

    def __init__(self, budget: Budget, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit!r}")
        self.budget = budget
        self.limit = limit
        """Tenants held at most."""
        self._buckets: OrderedDict[int, _Bucket] = OrderedDict()
        self._in_flight: dict[int, int] = {}
        """Tenant -> reservations held, with ``max_concurrent`` (none at 0)."""

    def __len__(self) -> int:
        return len(self._buckets)

    def reserve(self, tenant: int, tokens: int, now: float) -> Reservation | Refusal:
        """Take one request and ``tokens`` tokens (clamped to [0, 2**63 - 1]) from
        ``tenant``'s budgets, or nothing and say why and for how long."""
        tokens = min(max(tokens, 0), _MAX_COUNT)
        tpm = self.budget.tokens_per_minute
        rpm = self.budget.requests_per_minute
        if tpm is not None and tokens > tpm:
            return Refusal(
                retry_after=0.0,
                reason=f"request of {tokens} tokens exceeds the limit of {tpm} tokens per minute",
                headers=self.headers(tenant, now),
                too_large=True,
                tokens=True,
            )
        bucket = self._take(tenant, now)
        short: list[str] = []
        wait = 0.0
        most = self.budget.max_concurrent
        if most is not None and self._in_flight.get(tenant, 0) >= most:
            wait = CONCURRENCY_RETRY
            short.append(f"{most} requests in flight")
        if rpm is not None and bucket.requests < 1:
            wait = (1 - bucket.requests) * 60 / rpm
            short.append(f"{rpm} requests per minute")
        if tpm is not None and bucket.tokens < tokens:
            wait = max(wait, (tokens - bucket.tokens) * 60 / tpm)
            left = max(0, math.floor(bucket.tokens))
            short.append(f"{tpm} tokens per minute ({left} left, {tokens} requested)")
        if short:
            self._keep(tenant, bucket, now)
            return Refusal(
                retry_after=max(wait, _MIN_RETRY),
                reason="rate limit reached: " + ", ".join(short),
                headers=self._headers(bucket),
                too_large=False,
                tokens=tpm is not None and bucket.tokens < tokens,
            )
        if rpm is not None:
            bucket.requests -= 1
        if tpm is not None:
            bucket.tokens -= tokens
        self._keep(tenant, bucket, now)
        if most is not None:
            self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        return Reservation(tenant=tenant, tokens=tokens, leased=most is not None)

    def in_flight(self, tenant: int) -> int:
        """The reservations ``tenant`` holds now (counted with ``max_concurrent`` only)."""
        return self._in_flight.get(tenant, 0)

    def settle(self, reservation: Reservation, used: int, now: float) -> None:
        """Correct a reservation to the tokens really ``used`` (clamped to [0, 2**63 - 1]):
        give back what was not used (up to capacity) or charge the excess (down to
        -capacity); free its ``max_concurrent`` slot."""
        if reservation.leased:
            held = self._in_flight.get(reservation.tenant, 0) - 1
            if held > 0:
                self._in_flight[reservation.tenant] = held
            else:
                self._in_flight.pop(reservation.tenant, None)
        tpm = self.budget.tokens_per_minute
        correction = reservation.tokens - min(max(used, 0), _MAX_COUNT)
        if tpm is None or correction == 0:
            return
        bucket = self._take(reservation.tenant, now)
        bucket.tokens = max(min(bucket.tokens + correction, tpm), -tpm)
        self._keep(reservation.tenant, bucket, now)

    def headers(self, tenant: int, now: float) -> Headers:
        """The ``x-ratelimit-*`` headers of ``tenant``'s state at ``now`` (only those of the
        budgets configured); changes nothing."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return self._headers(self._full(now))
        level = _Bucket(bucket.tokens, bucket.requests, bucket.updated)
        self._refill(level, now)
        return self._headers(level)

    # -- buckets -------------------------------------------------------------------------------

    def _full(self, now: float) -> _Bucket:
        return _Bucket(
            float(self.budget.tokens_per_minute or 0),
            float(self.budget.requests_per_minute or 0),
            now,
        )

    def _refill(self, bucket: _Bucket, now: float) -> None:
        elapsed = now - bucket.updated
        if elapsed <= 0:  # a clock that went back refills nothing
            return
        bucket.updated = now
        tpm = self.budget.tokens_per_minute
        rpm = self.budget.requests_per_minute
        if tpm is not None:
            bucket.tokens = min(tpm, bucket.tokens + elapsed * tpm / 60)
        if rpm is not None:
            bucket.requests = min(rpm, bucket.requests + elapsed * rpm / 60)

    def _is_full(self, bucket: _Bucket) -> bool:
        tpm = self.budget.tokens_per_minute
        rpm = self.budget.requests_per_minute
        return (tpm is None or bucket.tokens >= tpm) and (rpm is None or bucket.requests >= rpm)

    def _take(self, tenant: int, now: float) -> _Bucket:
        """The tenant's bucket refilled to ``now``, out of the map (``_keep`` puts it back)."""
        bucket = self._buckets.pop(tenant, None)
        if bucket is None:
            return self._full(now)
        self._refill(bucket, now)
        return bucket

    def _keep(self, tenant: int, bucket: _Bucket, now: float) -> None:
        """Hold ``bucket`` as the most recently seen, unless it is full; then sweep."""
        buckets = self._buckets
        if not self._is_full(bucket):
            buckets[tenant] = bucket
        for _ in range(_SWEEP):
            if not buckets:
                return
            oldest_tenant, oldest = next(iter(buckets.items()))
            if len(buckets) <= self.limit:
                level = _Bucket(oldest.tokens, oldest.requests, oldest.updated)
                self._refill(level, now)
                if not self._is_full(level):
                    return
            del buckets[oldest_tenant]

    def _headers(self, bucket: _Bucket) -> Headers:
        return budget_headers(self.budget, bucket.tokens, bucket.requests)


def budget_headers(budget: Budget, tokens: float, requests: float) -> Headers:
    """The ``x-ratelimit-*`` headers of a tenant whose buckets hold ``tokens`` and
    ``requests`` (only those of the budgets configured): OpenAI's names and formats."""
    tpm = budget.tokens_per_minute
    rpm = budget.requests_per_minute
    limits: list[tuple[bytes, bytes]] = []
    remaining: list[tuple[bytes, bytes]] = []
    resets: list[tuple[bytes, bytes]] = []
    for kind, capacity, level in (
        (b"requests", rpm, requests),
        (b"tokens", tpm, tokens),
    ):
        if capacity is None:
            continue
        limits.append((b"x-ratelimit-limit-" + kind, b"%d" % capacity))
        remaining.append((b"x-ratelimit-remaining-" + kind, b"%d" % max(0, math.floor(level))))
        reset = format_duration((capacity - level) * 60 / capacity)
        resets.append((b"x-ratelimit-reset-" + kind, reset))
    return (*limits, *remaining, *resets)
