"""Fleet-wide budgets: the Lua scripts every replica runs against the store, and what their
replies mean.

What it obeys, and why:

- **The same rules as one process.** ``routing/ratelimit.py`` defines a tenant's budgets (a
  token bucket of ``tokens_per_minute``, one of ``requests_per_minute``, refilled
  continuously over a minute; a count of ``max_concurrent`` requests in flight). Here the
  same buckets live in the store, so every replica takes from one budget: reserve on
  admission (the request's expected tokens, one request, one concurrency lease), settle
  with the usage the answer reports, release the lease at the end. The arithmetic is
  ratelimit's, line for line, in Lua: a refusal names the same limits and the same wait.
- **Atomic, one round trip.** A reservation is one ``EVALSHA`` of ``RESERVE``: the script
  refills, checks every budget and takes from all of them, or from none, in one step that
  no other replica's script interleaves with (Redis runs a script alone). Settles and lease
  renewals are scripts too, batched by the driver off the request's path.
- **The store's clock.** Scripts read ``TIME`` on the Redis server: replicas whose clocks
  disagree still refill one bucket at one rate, and a lease's expiry means the same to all.
- **Leases expire.** A tenant's leases are a sorted set, member -> expiry (store seconds).
  A replica renews the leases it holds every ``HEARTBEAT`` seconds (``RENEW``); the
  reservation script prunes expired ones before it counts. So a replica that dies (SIGKILL,
  a partition) frees its tenants' slots within ``LEASE_TTL`` seconds.
- **The replicas seen.** Each replica (each process that admits requests: a worker of
  ``--workers N`` counts, since each enforces its own share when the store is away) adds
  itself to ``REPLICAS`` with an expiry every ``HEARTBEAT`` seconds (``ANNOUNCE``, which also
  prunes and counts). The count it last read is what ``on_store_error = "local"`` divides
  the budgets by (``ratelimit.Budget.share``).
- **Bounded state.** A bucket that refills to full is the same as none: its hash expires
  ``BUCKET_TTL_MS`` after its last change (a debt is paid off within two minutes, as in
  ratelimit); a lease set expires with its last lease.
- **Nothing read is trusted.** A reply that is not what the script returns raises
  ``BadReply``; the caller counts it as a store error.

Pure: no I/O and no clock; the driver (``trio/fleetbudgets.py``) runs the scripts.
"""

from __future__ import annotations

import enum
import math

import attrs

from muxproxy.routing.ratelimit import CONCURRENCY_RETRY, Budget, Refusal, budget_headers

__all__ = [
    "ANNOUNCE",
    "HEARTBEAT",
    "LEASE_TTL",
    "REPLICAS",
    "RESERVE",
    "RESERVE_TIMEOUT",
    "SETTLE",
    "Ask",
    "BadReply",
    "Short",
    "Verdict",
    "bucket_keys",
    "limits_of",
    "read_reply",
    "refusal_of",
    "replicas_of",
]

PREFIX = "muxproxy:fleet:"
REPLICAS = PREFIX + "replicas"
"""The sorted set of replicas: member (a replica's id) -> expiry, in store seconds."""

HEARTBEAT = 1.0
"""Seconds between a replica's announcements and lease renewals."""
REPLICA_TTL = 5.0
"""Seconds a replica counts as present after its last announcement: five heartbeats, so a
slow second is not a departure."""
LEASE_TTL = 10.0
"""Seconds a concurrency lease outlives its last renewal: how long a dead replica's streams
still count against their tenants."""
BUCKET_TTL_MS = 130_000
"""A bucket's hash expires this long after its last change: a bucket is full two minutes
after any change at most (its debt is at most one capacity), and a full bucket is none."""
RESERVE_TIMEOUT = 0.25
"""Seconds a reservation may take before the store counts as failed for it: an admission
waits at most this long for the store (then ``on_store_error`` decides)."""

# Redis runs each script alone (EVAL is atomic); TIME is the server's clock. Levels are
# returned as strings: a Lua number becomes a Redis integer, which would drop fractions.
_REFILL = """
local function refill(key, tpm, rpm, now)
  local b = redis.call('HMGET', key, 't', 'r', 'u')
  local tokens = tonumber(b[1]) or tpm
  local requests = tonumber(b[2]) or rpm
  local updated = tonumber(b[3]) or now
  local elapsed = now - updated
  if elapsed > 0 then
    updated = now
    if tpm > 0 then tokens = math.min(tpm, tokens + elapsed * tpm / 60) end
    if rpm > 0 then requests = math.min(rpm, requests + elapsed * rpm / 60) end
  end
  return tokens, requests, updated
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

RESERVE = (
    _REFILL
    + """
-- KEYS: the tenant's bucket (hash), its leases (sorted set).
-- ARGV: tpm, rpm, max_concurrent (0: no such budget), tokens, lease member, lease ttl (s),
-- bucket ttl (ms), retry seconds of a concurrency refusal.
local tpm, rpm, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local tokens, requests, updated = refill(KEYS[1], tpm, rpm, now)
local held = 0
if most > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  held = redis.call('ZCARD', KEYS[2])
end
local short, wait = 0, 0
if tpm > 0 and want > tpm then
  short = 8
else
  if most > 0 and held >= most then
    short = short + 1
    wait = tonumber(ARGV[8])
  end
  if rpm > 0 and requests < 1 then
    short = short + 2
    wait = math.max(wait, (1 - requests) * 60 / rpm)
  end
  if tpm > 0 and tokens < want then
    short = short + 4
    wait = math.max(wait, (want - tokens) * 60 / tpm)
  end
end
if short == 0 then
  if rpm > 0 then requests = requests - 1 end
  if tpm > 0 then tokens = tokens - want end
  if most > 0 then
    local ttl = tonumber(ARGV[6])
    redis.call('ZADD', KEYS[2], now + ttl, ARGV[5])
    redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 2000))
    held = held + 1
  end
end
if (tpm > 0 or rpm > 0) and short ~= 8 then
  redis.call('HSET', KEYS[1], 't', tostring(tokens), 'r', tostring(requests), 'u',
    tostring(updated))
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
end
return {short, tostring(wait), tostring(tokens), tostring(requests), held}
"""
)
"""Reserve one request of ``tokens`` (and a lease) from a tenant's budgets, or nothing.

Returns ``{short, wait, tokens, requests, held}``: ``short`` the budgets that refused it
(``Short`` flags; 0: reserved), ``wait`` the seconds until they would not, the levels of the
buckets after it (strings), and the leases held (this one included)."""

SETTLE = (
    _REFILL
    + """
-- KEYS: the tenant's bucket, its leases. ARGV: tpm, rpm, correction (tokens reserved minus
-- tokens used), lease member ('' for none), bucket ttl (ms).
if ARGV[4] ~= '' then redis.call('ZREM', KEYS[2], ARGV[4]) end
local tpm, rpm, correction = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and correction ~= 0 then
  local tokens, requests, updated = refill(KEYS[1], tpm, rpm, now)
  tokens = math.max(math.min(tokens + correction, tpm), -tpm)
  redis.call('HSET', KEYS[1], 't', tostring(tokens), 'r', tostring(requests), 'u',
    tostring(updated))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
return 1
"""
)
"""Correct a reservation to the tokens used (as ``RateLimiter.settle``: back up to capacity,
a debt down to -capacity) and release its lease."""

RENEW = """
-- KEYS: a tenant's leases. ARGV: lease ttl (s), then the members of this replica's leases.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 2000))
return 1
"""
"""Push the expiry of leases still held (``XX``: a lease already pruned stays gone)."""

ANNOUNCE = """
-- KEYS: the replicas. ARGV: this replica's id, its ttl (s).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 10000))
return redis.call('ZCARD', KEYS[1])
"""
"""Say this replica is present, drop those that went quiet; the number present."""


class Short(enum.IntFlag):
    """Which budgets refused a reservation (the ``short`` of ``RESERVE``'s reply)."""

    CONCURRENCY = 1
    REQUESTS = 2
    TOKENS = 4
    TOO_LARGE = 8
    """The request's tokens exceed the whole per-minute budget: no wait makes it fit."""


@attrs.frozen(kw_only=True)
class Ask:
    """One admission's reservation, as the core asks for it and the driver runs it."""

    request: int
    """The exchange's ident (unique in its process): with the replica's id, the lease's
    member."""
    group: str
    tenant: int
    """``admit.tenant_of`` of the request (a hash, never the credential)."""
    budget: Budget
    tokens: int
    """The request's expected tokens (``max_tokens`` or ``default_max_tokens``)."""

    @property
    def leased(self) -> bool:
        """Whether it takes a ``max_concurrent`` lease."""
        return self.budget.max_concurrent is not None


class BadReply(Exception):
    """A reply that is not what the script returns (another program's key, a bug)."""


@attrs.frozen(kw_only=True)
class Verdict:
    """``RESERVE``'s reply, checked."""

    short: Short
    """Empty: reserved."""
    wait: float
    tokens: float
    """The token bucket's level after the reservation (or the refusal)."""
    requests: float
    held: int
    """The tenant's leases, this one included when reserved."""

    @property
    def reserved(self) -> bool:
        return not self.short


def bucket_keys(group: str, tenant: int) -> tuple[str, str]:
    """The tenant's keys in ``group``: its bucket and its leases. The braces are a Redis
    Cluster hash tag: both keys share a slot, as one script's keys must."""
    stem = f"{PREFIX}budget:{{{group}:{tenant:016x}}}"
    return stem, stem + ":leases"


def limits_of(budget: Budget) -> tuple[int, int, int]:
    """``(tpm, rpm, max_concurrent)`` as the scripts take them: 0 for no such budget."""
    return (
        budget.tokens_per_minute or 0,
        budget.requests_per_minute or 0,
        budget.max_concurrent or 0,
    )


def reserve_args(budget: Budget, tokens: int, lease: str) -> list[str | int | float]:
    """``RESERVE``'s ARGV for a request of ``tokens`` holding ``lease`` (a unique member)."""
    tpm, rpm, most = limits_of(budget)
    return [tpm, rpm, most, max(tokens, 0), lease, LEASE_TTL, BUCKET_TTL_MS, CONCURRENCY_RETRY]


def settle_args(tpm: int, rpm: int, correction: int, lease: str) -> list[str | int]:
    """``SETTLE``'s ARGV."""
    return [tpm, rpm, correction, lease, BUCKET_TTL_MS]


MAX_NUMBER = 2**53
"""Largest magnitude of a number in a reply: Lua's numbers are doubles, exact up to here.
A bucket level or a wait beyond it is no script's, and would overflow the arithmetic of the
``x-ratelimit-*`` headers."""


def _number(value: object) -> float:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BadReply(f"expected a number, got {value!r}"[:200])
    try:
        number = float(value)
    except (ValueError, OverflowError):  # OverflowError: an integer past every float
        raise BadReply(f"expected a number, got {value!r}"[:200]) from None
    if not math.isfinite(number) or abs(number) > MAX_NUMBER:
        raise BadReply(f"expected a finite number within 2**53, got {value!r}"[:200])
    return number


def read_reply(reply: object) -> Verdict:
    """``RESERVE``'s reply as a ``Verdict``; raises ``BadReply`` for anything else."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 5:
        raise BadReply(f"expected a list of 5, got {reply!r}"[:200])
    short, wait, tokens, requests, held = (_number(item) for item in reply)
    if short != int(short) or not 0 <= short < 16 or held < 0 or wait < 0:
        raise BadReply(f"out of range: {reply!r}"[:200])
    return Verdict(
        short=Short(int(short)), wait=wait, tokens=tokens, requests=requests, held=int(held)
    )


def replicas_of(reply: object) -> int:
    """``ANNOUNCE``'s reply (the replicas present) as a count of at least 1; raises
    ``BadReply`` for anything but a whole number >= 0."""
    count = _number(reply)
    if count != int(count) or count < 0:
        raise BadReply(f"expected a count of replicas, got {reply!r}"[:200])
    return max(1, int(count))


def refusal_of(verdict: Verdict, budget: Budget, tokens: int) -> Refusal:
    """The 429's ``Refusal`` for a refused reservation of ``tokens``: the same reason, wait
    and ``x-ratelimit-*`` fields as ``RateLimiter.reserve`` gives for one process."""
    headers = budget_headers(budget, verdict.tokens, verdict.requests)
    tpm = budget.tokens_per_minute
    if Short.TOO_LARGE in verdict.short:
        return Refusal(
            retry_after=0.0,
            reason=f"request of {tokens} tokens exceeds the limit of {tpm} tokens per minute",
            headers=headers,
            too_large=True,
            tokens=True,
        )
    short: list[str] = []
    if Short.CONCURRENCY in verdict.short:
        short.append(f"{budget.max_concurrent} requests in flight")
    if Short.REQUESTS in verdict.short:
        short.append(f"{budget.requests_per_minute} requests per minute")
    if Short.TOKENS in verdict.short:
        left = max(0, math.floor(verdict.tokens))
        short.append(f"{tpm} tokens per minute ({left} left, {tokens} requested)")
    return Refusal(
        retry_after=max(verdict.wait, 0.001),
        reason="rate limit reached: " + ", ".join(short),
        headers=headers,
        too_large=False,
        tokens=Short.TOKENS in verdict.short,
    )
