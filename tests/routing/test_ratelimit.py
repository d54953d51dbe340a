"""Per-tenant token and request budgets (``muxproxy.routing.ratelimit``): token buckets with
OpenAI's headers, settled to real usage, bounded in memory, never overspent."""

from __future__ import annotations

import itertools
import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.routing.ratelimit import (
    Budget,
    RateLimiter,
    Refusal,
    Reservation,
    format_duration,
)

TENANT = 4711


def granted(result: Reservation | Refusal) -> Reservation:
    assert isinstance(result, Reservation), result
    return result


def refused(result: Reservation | Refusal) -> Refusal:
    assert isinstance(result, Refusal), result
    return result


def header(limiter: RateLimiter, name: bytes, now: float, tenant: int = TENANT) -> bytes:
    return dict(limiter.headers(tenant, now))[name]


# -- budgets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "60"])
def test_a_budget_is_a_positive_integer_or_none(bad: object) -> None:
    with pytest.raises(ValueError, match="tokens_per_minute must be a positive integer"):
        Budget(tokens_per_minute=bad)  # type: ignore[arg-type]  # the wrong types are the test
    with pytest.raises(ValueError, match="requests_per_minute must be a positive integer"):
        Budget(requests_per_minute=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit must be at least 1"):
        RateLimiter(Budget(), limit=0)


def test_without_budgets_everything_passes_and_nothing_is_held() -> None:
    limiter = RateLimiter(Budget())
    for n in range(100):
        assert granted(limiter.reserve(n, 10**9, 0.0)).tokens == 10**9
    assert len(limiter) == 0
    assert limiter.headers(1, 0.0) == ()


# -- reserving ---------------------------------------------------------------------------------


def test_a_new_tenant_starts_full_and_gets_openai_headers() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=150_000, requests_per_minute=60))
    assert limiter.headers(TENANT, 0.0) == (
        (b"x-ratelimit-limit-requests", b"60"),
        (b"x-ratelimit-limit-tokens", b"150000"),
        (b"x-ratelimit-remaining-requests", b"60"),
        (b"x-ratelimit-remaining-tokens", b"150000"),
        (b"x-ratelimit-reset-requests", b"0s"),
        (b"x-ratelimit-reset-tokens", b"0s"),
    )
    assert granted(limiter.reserve(TENANT, 16, 0.0)) == Reservation(tenant=TENANT, tokens=16)
    # One request refills in 1 s (60 a minute); 16 tokens in 6.4 ms (2,500 a second).
    assert limiter.headers(TENANT, 0.0) == (
        (b"x-ratelimit-limit-requests", b"60"),
        (b"x-ratelimit-limit-tokens", b"150000"),
        (b"x-ratelimit-remaining-requests", b"59"),
        (b"x-ratelimit-remaining-tokens", b"149984"),
        (b"x-ratelimit-reset-requests", b"1s"),
        (b"x-ratelimit-reset-tokens", b"7ms"),
    )


def test_only_the_configured_budgets_have_headers() -> None:
    tokens_only = RateLimiter(Budget(tokens_per_minute=1000))
    assert [name for name, _ in tokens_only.headers(TENANT, 0.0)] == [
        b"x-ratelimit-limit-tokens",
        b"x-ratelimit-remaining-tokens",
        b"x-ratelimit-reset-tokens",
    ]
    requests_only = RateLimiter(Budget(requests_per_minute=5))
    assert [name for name, _ in requests_only.headers(TENANT, 0.0)] == [
        b"x-ratelimit-limit-requests",
        b"x-ratelimit-remaining-requests",
        b"x-ratelimit-reset-requests",
    ]


def test_a_refusal_takes_nothing_neither_request_nor_tokens() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=100, requests_per_minute=2))
    granted(limiter.reserve(TENANT, 60, 0.0))
    refusal = refused(limiter.reserve(TENANT, 60, 0.0))  # 40 tokens left
    assert not refusal.too_large
    assert refusal.reason == "rate limit reached: 100 tokens per minute (40 left, 60 requested)"
    assert refusal.headers == limiter.headers(TENANT, 0.0)
    assert header(limiter, b"x-ratelimit-remaining-requests", 0.0) == b"1"  # not taken
    granted(limiter.reserve(TENANT, 40, 0.0))  # the second request, the last 40 tokens
    refusal = refused(limiter.reserve(TENANT, 0, 0.0))
    assert refusal.reason == "rate limit reached: 2 requests per minute"
    assert refusal.retry_after == pytest.approx(30.0)  # one request in 60 / 2 s


def test_retry_after_is_when_enough_has_refilled() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=600))  # 10 tokens a second
    granted(limiter.reserve(TENANT, 600, 100.0))
    refusal = refused(limiter.reserve(TENANT, 100, 100.0))
    assert refusal.retry_after == pytest.approx(10.0)
    refused(limiter.reserve(TENANT, 100, 109.99))
    granted(limiter.reserve(TENANT, 100, 110.0))


def test_retry_after_waits_for_the_later_of_both_budgets() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=600, requests_per_minute=1))
    granted(limiter.reserve(TENANT, 300, 0.0))
    refusal = refused(limiter.reserve(TENANT, 600, 0.0))
    assert "1 requests per minute" in refusal.reason and "600 tokens" in refusal.reason
    assert refusal.retry_after == pytest.approx(60.0)  # tokens in 30 s, the request in 60 s


def test_a_request_larger_than_the_whole_budget_can_never_fit() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=1000, requests_per_minute=10))
    refusal = refused(limiter.reserve(TENANT, 1001, 0.0))
    assert refusal.too_large and refusal.retry_after == 0.0
    assert refusal.reason == "request of 1001 tokens exceeds the limit of 1000 tokens per minute"
    assert refusal.headers == limiter.headers(TENANT, 0.0)
    assert len(limiter) == 0  # nothing taken, nothing held
    granted(limiter.reserve(TENANT, 1000, 0.0))


def test_negative_counts_are_zero() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=100))
    reservation = granted(limiter.reserve(TENANT, -50, 0.0))
    assert reservation.tokens == 0
    assert header(limiter, b"x-ratelimit-remaining-tokens", 0.0) == b"100"
    reservation = granted(limiter.reserve(TENANT, 10, 0.0))
    limiter.settle(reservation, -7, 0.0)  # as if 0 were used: all 10 back
    assert header(limiter, b"x-ratelimit-remaining-tokens", 0.0) == b"100"


def test_absurd_counts_are_clamped_never_an_overflow() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=1000))
    refusal = refused(limiter.reserve(TENANT, 10**5000, 0.0))  # past int's 4,300-digit str()
    assert refusal.too_large and "request of 9223372036854775807 tokens" in refusal.reason
    assert granted(RateLimiter(Budget()).reserve(TENANT, 10**5000, 0.0)).tokens == 2**63 - 1
    limiter.settle(granted(limiter.reserve(TENANT, 1, 0.0)), 10**5000, 0.0)  # past a float
    assert header(limiter, b"x-ratelimit-reset-tokens", 0.0) == b"2m0s"


def test_tenants_have_budgets_of_their_own() -> None:
    limiter = RateLimiter(Budget(requests_per_minute=1))
    granted(limiter.reserve(1, 0, 0.0))
    refused(limiter.reserve(1, 0, 0.0))
    granted(limiter.reserve(2, 0, 0.0))


def test_a_clock_that_goes_back_refills_nothing() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=60))
    granted(limiter.reserve(TENANT, 60, 100.0))
    refused(limiter.reserve(TENANT, 1, 50.0))
    assert header(limiter, b"x-ratelimit-remaining-tokens", 50.0) == b"0"
    granted(limiter.reserve(TENANT, 1, 101.0))


# -- settling ----------------------------------------------------------------------------------


def test_settling_gives_back_what_was_not_used() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=1000))
    reservation = granted(limiter.reserve(TENANT, 500, 0.0))
    limiter.settle(reservation, 100, 0.0)
    assert header(limiter, b"x-ratelimit-remaining-tokens", 0.0) == b"900"


def test_a_refund_never_fills_a_bucket_beyond_capacity() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=1000))
    reservation = granted(limiter.reserve(TENANT, 800, 0.0))
    limiter.settle(reservation, 0, 30.0)  # 500 refilled meanwhile: 700 + 800 is capped
    assert header(limiter, b"x-ratelimit-remaining-tokens", 30.0) == b"1000"
    assert len(limiter) == 0  # full is the same as no entry
    granted(limiter.reserve(TENANT, 1000, 30.0))
    refused(limiter.reserve(TENANT, 1, 30.0))


def test_settling_charges_usage_beyond_the_estimate_into_debt() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=1000))
    reservation = granted(limiter.reserve(TENANT, 1000, 0.0))
    limiter.settle(reservation, 1500, 0.0)  # level -500
    assert header(limiter, b"x-ratelimit-remaining-tokens", 0.0) == b"0"  # never negative
    assert header(limiter, b"x-ratelimit-reset-tokens", 0.0) == b"1m30s"  # 1,500 to refill
    refusal = refused(limiter.reserve(TENANT, 0, 0.0))  # even nothing, while in debt
    assert refusal.retry_after == pytest.approx(30.0)
    assert refused(limiter.reserve(TENANT, 1, 0.0)).retry_after == pytest.approx(30.06)
    granted(limiter.reserve(TENANT, 0, 30.0))


def test_a_bogus_usage_figure_locks_a_tenant_out_for_two_minutes_at_most() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=1000))
    limiter.settle(granted(limiter.reserve(TENANT, 10, 0.0)), 10**15, 0.0)
    assert header(limiter, b"x-ratelimit-reset-tokens", 0.0) == b"2m0s"
    assert refused(limiter.reserve(TENANT, 1000, 0.0)).retry_after == pytest.approx(120.0)
    granted(limiter.reserve(TENANT, 1000, 120.0))


def test_a_settle_after_the_tenant_was_dropped_starts_from_full() -> None:
    limiter = RateLimiter(Budget(tokens_per_minute=1000))
    reservation = granted(limiter.reserve(TENANT, 600, 0.0))
    granted(limiter.reserve(2, 1, 60.0))  # TENANT is full again by now and swept
    assert len(limiter) == 1
    limiter.settle(reservation, 900, 60.0)  # 300 over the estimate
    assert header(limiter, b"x-ratelimit-remaining-tokens", 60.0) == b"700"


# -- memory ------------------------------------------------------------------------------------


def test_at_most_limit_tenants_and_the_least_recently_seen_go_first() -> None:
    limiter = RateLimiter(Budget(requests_per_minute=10), limit=3)
    for tenant in range(10):
        granted(limiter.reserve(tenant, 0, 0.0))
    granted(limiter.reserve(7, 0, 0.0))  # 7 is now the most recent; 8 the least
    granted(limiter.reserve(10, 0, 0.0))
    assert len(limiter) == 3
    remaining = {t: header(limiter, b"x-ratelimit-remaining-requests", 0.0, t) for t in range(11)}
    assert {t for t, left in remaining.items() if left != b"10"} == {7, 9, 10}
    assert remaining[7] == b"8"


def test_full_buckets_are_swept_a_few_per_call() -> None:
    limiter = RateLimiter(Budget(requests_per_minute=60))
    for tenant in range(100):
        granted(limiter.reserve(tenant, 0, 0.0))
    assert len(limiter) == 100
    sizes = []
    for call in range(20):
        granted(limiter.reserve(1000 + call, 0, 10.0))  # all of the first 100 are full again
        sizes.append(len(limiter))
    # Each call adds its tenant and drops at most 8 full ones: no call does unbounded work.
    assert sizes[0] == 100 + 1 - 8
    assert all(after >= before + 1 - 8 for before, after in itertools.pairwise(sizes))
    assert sizes[-1] == 20  # then only the 20 active tenants are left


# -- the duration format -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, b"0s"),
        (-3.0, b"0s"),
        (0.0001, b"1ms"),
        (0.02, b"20ms"),
        (0.999, b"999ms"),
        (1.0, b"1s"),
        (1.5, b"1.5s"),
        (8.64, b"8.64s"),
        (59.9991, b"1m0s"),
        (60.0, b"1m0s"),
        (360.0, b"6m0s"),
        (3723.004, b"1h2m3.004s"),
        (7200.0, b"2h0m0s"),
    ],
)
def test_durations_are_written_as_openai_writes_them(seconds: float, text: bytes) -> None:
    assert format_duration(seconds) == text


# -- the invariant -----------------------------------------------------------------------------


@attrs.frozen
class Event:
    at: float
    granted: int = 0
    """Tokens of a reservation granted now."""
    refund: int = 0
    """Tokens given back by a settle now (reserved minus used, when positive)."""
    is_grant: bool = False


operation = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 30_000), st.floats(0, 1.2)),
    st.tuples(st.just("settle"), st.integers(0, 30_000), st.floats(0, 2.5)),
)


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 5000),
    requests=st.none() | st.integers(1, 20),
    operations=st.lists(operation, max_size=60),
)
def test_concurrent_requests_never_overspend(
    capacity: int, requests: int | None, operations: list[tuple[str, int, float]]
) -> None:
    """For one tenant with capacity C tokens a minute (refill r = C / 60 per second), take
    any interleaving of reservations and settles (each settling one outstanding reservation
    with any usage, so requests overlap freely). For every window of consecutive events
    (a, ..., b) that ends with a granted reservation b:

        sum(tokens granted in the window) - sum(tokens refunded in the window)
            <= C + r * (time(b) - time(a))

    i.e. the tokens reserved and not given back within any window, of 60 s or any other
    length, never exceed the capacity plus the refill over the window. Usage charged beyond
    an estimate only lowers the level, so leaving it out keeps the bound honest."""
    limiter = RateLimiter(Budget(tokens_per_minute=capacity, requests_per_minute=requests))
    now = 0.0
    outstanding: list[Reservation] = []
    events: list[Event] = []
    for kind, step_ms, share in operations:
        now += step_ms / 1000
        if kind == "reserve":
            result = limiter.reserve(TENANT, math.floor(share * capacity), now)
            if isinstance(result, Reservation):
                outstanding.append(result)
                events.append(Event(now, granted=result.tokens, is_grant=True))
            else:
                assert result.too_large == (math.floor(share * capacity) > capacity)
                assert result.too_large or result.retry_after > 0
        elif outstanding:
            reservation = outstanding.pop(step_ms % len(outstanding))
            used = math.floor(share * reservation.tokens)
            limiter.settle(reservation, used, now)
            events.append(Event(now, refund=max(0, reservation.tokens - used)))
        remaining = int(header(limiter, b"x-ratelimit-remaining-tokens", now))
        assert 0 <= remaining <= capacity
    rate = capacity / 60
    for end, last in enumerate(events):
        if not last.is_grant:
            continue
        taken = 0
        for start in range(end, -1, -1):
            taken += events[start].granted - events[start].refund
            allowed = capacity + rate * (last.at - events[start].at)
            assert taken <= allowed + 1e-6 * capacity, (start, end, taken, allowed)


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 1000),
    steps=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 1000)), max_size=80),
)
def test_without_settles_a_minute_never_grants_more_than_two_capacities(
    capacity: int, steps: list[tuple[int, int]]
) -> None:
    """The plain statement for requests in flight at once: any 60 s sees at most C + C."""
    limiter = RateLimiter(Budget(tokens_per_minute=capacity))
    now = 0.0
    grants: list[tuple[float, int]] = []
    for step_ms, tokens in steps:
        now += step_ms / 1000
        result = limiter.reserve(TENANT, tokens, now)
        if isinstance(result, Reservation):
            grants.append((now, result.tokens))
    for at, _ in grants:
        in_minute = sum(tokens for when, tokens in grants if at <= when < at + 60)
        assert in_minute <= 2 * capacity + 1e-6 * capacity


def test_max_concurrent_holds_a_slot_per_reservation_until_it_is_settled() -> None:
    limiter = RateLimiter(Budget(max_concurrent=2))
    first, second = limiter.reserve(1, 10, 0.0), limiter.reserve(1, 10, 0.0)
    assert isinstance(first, Reservation) and first.leased and isinstance(second, Reservation)
    refused = limiter.reserve(1, 10, 0.0)
    assert isinstance(refused, Refusal) and refused.reason.endswith("2 requests in flight")
    assert refused.retry_after == 1.0 and not refused.too_large
    assert isinstance(limiter.reserve(2, 10, 0.0), Reservation)  # another tenant's own
    limiter.settle(first, 10, 1.0)
    assert limiter.in_flight(1) == 1
    assert isinstance(limiter.reserve(1, 10, 1.0), Reservation)
