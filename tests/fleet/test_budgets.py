"""``fleet/budgets.py``: the replies read as data, and the Lua scripts run by a real
``redis-server`` (``tests/services.py``), held against ``routing/ratelimit.py``'s rules."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import coredis
import pytest

from muxproxy.fleet.budgets import (
    ANNOUNCE,
    LEASE_TTL,
    RENEW,
    REPLICAS,
    RESERVE,
    SETTLE,
    BadReply,
    Short,
    Verdict,
    bucket_keys,
    read_reply,
    refusal_of,
    replicas_of,
    reserve_args,
    settle_args,
)
from muxproxy.routing.ratelimit import Budget, RateLimiter, Refusal

# -- the replies, as data ------------------------------------------------------------------


def test_a_reply_is_read_as_a_verdict() -> None:
    verdict = read_reply([0, b"0", b"744.5", b"9", 1])
    assert verdict == Verdict(short=Short(0), wait=0.0, tokens=744.5, requests=9.0, held=1)
    assert verdict.reserved
    refused = read_reply([5, b"1.5", b"-3", b"0", 4])
    assert refused.short == Short.CONCURRENCY | Short.TOKENS and not refused.reserved


@pytest.mark.parametrize(
    "reply",
    [None, b"OK", [0, b"0", b"1", b"1"], [16, b"0", b"1", b"1", 0], [0, b"nan", b"1", b"1", 0],
     [0, b"-1", b"1", b"1", 0], [0, b"0", b"x", b"1", 0], [1.5, b"0", b"1", b"1", 0],
     [0, b"0", b"1", b"1", -1], [True, b"0", b"1", b"1", 0],
     [0, b"0", b"1", b"1", 10**400], [4, b"0", b"-1.7e308", b"0", 0], [4, b"1e300", b"0", b"0", 0]],
)  # fmt: skip
def test_a_reply_no_script_returns_is_refused(reply: object) -> None:
    with pytest.raises(BadReply):
        read_reply(reply)


@pytest.mark.parametrize(
    ("reply", "count"), [(0, 1), (3, 3), (b"2", 2), (2**53, 2**53)]
)  # fmt: skip
def test_the_replicas_seen_are_a_count_of_at_least_one(reply: object, count: int) -> None:
    assert replicas_of(reply) == count


@pytest.mark.parametrize("reply", [b"x", None, -1, 1.5, [3], True, 10**400])
def test_a_count_of_replicas_no_script_returns_is_refused(reply: object) -> None:
    with pytest.raises(BadReply):
        replicas_of(reply)


def test_a_refusal_says_what_one_process_would() -> None:
    """The same reason, wait and fields as ``RateLimiter.reserve`` for the same levels."""
    budget = Budget(tokens_per_minute=1000, requests_per_minute=10)
    local = RateLimiter(budget)
    assert not isinstance(local.reserve(1, 900, now=0.0), Refusal)
    refused = local.reserve(1, 200, now=0.0)
    assert isinstance(refused, Refusal)
    verdict = Verdict(short=Short.TOKENS, wait=refused.retry_after, tokens=100, requests=9, held=0)
    assert refusal_of(verdict, budget, 200) == refused


def test_a_request_larger_than_the_budget_can_never_fit() -> None:
    verdict = Verdict(short=Short.TOO_LARGE, wait=0, tokens=10, requests=1, held=0)
    refusal = refusal_of(verdict, Budget(tokens_per_minute=10), 11)
    assert refusal.too_large and refusal.retry_after == 0
    assert "exceeds the limit of 10 tokens per minute" in refusal.reason


def test_a_concurrency_refusal_names_the_limit() -> None:
    verdict = Verdict(short=Short.CONCURRENCY, wait=1.0, tokens=0, requests=0, held=4)
    refusal = refusal_of(verdict, Budget(max_concurrent=4), 1)
    assert refusal.reason == "rate limit reached: 4 requests in flight"
    assert refusal.retry_after == 1.0 and refusal.headers == ()


def test_a_budget_shared_by_replicas_rounds_each_share_up() -> None:
    budget = Budget(tokens_per_minute=1000, requests_per_minute=10, max_concurrent=4)
    assert budget.share(3) == Budget(tokens_per_minute=334, requests_per_minute=4, max_concurrent=2)
    assert budget.share(0) == budget.share(1) == budget
    assert Budget(max_concurrent=2).share(5) == Budget(max_concurrent=1)


def test_a_tenants_keys_share_a_cluster_slot() -> None:
    bucket, leases = bucket_keys("gpus", 0xABC)
    assert bucket == "muxproxy:fleet:budget:{gpus:0000000000000abc}"
    assert leases == bucket + ":leases"


# -- the scripts, in Redis -----------------------------------------------------------------


@pytest.fixture
async def redis(redis_server: Any) -> AsyncIterator[coredis.Redis[bytes]]:
    async with coredis.Redis.from_url(redis_server.url, verify_version=False) as client:
        yield client


async def reserve(
    client: coredis.Redis[bytes], budget: Budget, tokens: int, lease: str = "", tenant: int = 1
) -> Verdict:
    keys = list(bucket_keys("gpus", tenant))
    script = client.register_script(RESERVE)
    return read_reply(await script(keys, reserve_args(budget, tokens, lease)))


async def settle(
    client: coredis.Redis[bytes], budget: Budget, correction: int, lease: str = ""
) -> None:
    keys = list(bucket_keys("gpus", 1))
    tpm, rpm = budget.tokens_per_minute or 0, budget.requests_per_minute or 0
    await client.register_script(SETTLE)(keys, settle_args(tpm, rpm, correction, lease))


async def test_reservations_take_from_the_bucket_until_it_is_spent(
    redis: coredis.Redis[bytes],
) -> None:
    budget = Budget(tokens_per_minute=1000, requests_per_minute=100)
    first = await reserve(redis, budget, 600)
    assert first.reserved and 399 < first.tokens <= 401 and 98 < first.requests <= 99.1
    second = await reserve(redis, budget, 600)
    assert second.short == Short.TOKENS
    # The wait is what refills the shortfall at 1000 a minute: about 200 tokens, 12 s.
    assert 11.5 < second.wait <= 12.1
    assert (await reserve(redis, budget, 1001)).short == Short.TOO_LARGE


async def test_a_settle_gives_back_what_was_not_used_and_charges_the_excess(
    redis: coredis.Redis[bytes],
) -> None:
    budget = Budget(tokens_per_minute=1000)
    assert (await reserve(redis, budget, 900)).reserved
    await settle(redis, budget, 900 - 100)  # 100 used of 900
    assert (await reserve(redis, budget, 800)).reserved
    await settle(redis, budget, 800 - 2900)  # far more used: a debt, down to -capacity
    level = (await reserve(redis, budget, 1)).tokens
    assert -1000 <= level < -990


async def test_requests_per_minute_hold(redis: coredis.Redis[bytes]) -> None:
    budget = Budget(requests_per_minute=3)
    verdicts = [await reserve(redis, budget, 0) for _ in range(4)]
    assert [v.reserved for v in verdicts] == [True, True, True, False]
    assert verdicts[3].short == Short.REQUESTS and 19 < verdicts[3].wait <= 20.1


async def test_leases_count_until_released(redis: coredis.Redis[bytes]) -> None:
    budget = Budget(max_concurrent=2)
    assert (await reserve(redis, budget, 1, lease="r:1")).held == 1
    assert (await reserve(redis, budget, 1, lease="r:2")).held == 2
    refused = await reserve(redis, budget, 1, lease="r:3")
    assert refused.short == Short.CONCURRENCY and refused.held == 2
    await settle(redis, budget, 0, lease="r:1")
    assert (await reserve(redis, budget, 1, lease="r:3")).reserved
    # Nothing but leases: no bucket is kept for a budget without one.
    bucket, _ = bucket_keys("gpus", 1)
    assert not await redis.exists([bucket])


async def test_a_lease_nobody_renews_expires_and_a_renewed_one_does_not(
    redis: coredis.Redis[bytes],
) -> None:
    budget = Budget(max_concurrent=2)
    _, leases = bucket_keys("gpus", 1)
    assert (await reserve(redis, budget, 1, lease="dead:1")).reserved
    assert (await reserve(redis, budget, 1, lease="live:1")).reserved
    # Both leases' expiry moved into the past (as LEASE_TTL seconds without renewal would),
    # then the live replica renews its own: the dead one's slot is free again.
    await redis.zadd(leases, {"dead:1": 1.0, "live:1": 1.0})
    await redis.register_script(RENEW)([leases], [LEASE_TTL, "live:1", "gone:9"])
    verdict = await reserve(redis, budget, 1, lease="new:1")
    assert verdict.reserved and verdict.held == 2
    members = {member for member, _ in await redis.zrange(leases, 0, -1, withscores=True)}
    assert members == {b"live:1", b"new:1"}  # a renewal never brings back a lease


async def test_tenants_have_budgets_of_their_own(redis: coredis.Redis[bytes]) -> None:
    budget = Budget(requests_per_minute=1)
    assert (await reserve(redis, budget, 0, tenant=1)).reserved
    assert (await reserve(redis, budget, 0, tenant=2)).reserved
    assert not (await reserve(redis, budget, 0, tenant=1)).reserved


async def test_replicas_are_counted_until_they_go_quiet(redis: coredis.Redis[bytes]) -> None:
    announce = redis.register_script(ANNOUNCE)
    assert await announce([REPLICAS], ["a", 5]) == 1
    assert await announce([REPLICAS], ["b", 5]) == 2
    assert await announce([REPLICAS], ["a", 5]) == 2
    await redis.zadd(REPLICAS, {"b": 1.0})  # b's last announcement expired
    assert await announce([REPLICAS], ["a", 5]) == 1
