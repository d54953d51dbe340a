"""The runtime routing state of one upstream group, and its one question: which servers, in
what order, for this request?

Pure: time comes in as ``now``, nothing here does I/O, and two processes built from the same
configuration and runtime state give the same answers for the same keys (rendezvous hashing
over stable server ids). The order it returns is the order the exchange tries on failure:

1. a pinned server (named by a sticky cookie) while it takes existing sessions (below) —
   also while it drains, so ongoing conversations stay where their KV cache is;
2. with a session key seen within ``sticky.session_idle`` seconds: the server it was last
   sent to (``affinity.py``), while that server takes existing sessions;
3. with a session key: weighted rendezvous hashing over the usable servers with weight > 0;
4. with a prefix key (``affinity = "prefix"``, no session key): consistent hashing with
   bounded loads (``load.bounded_order``), a server with a free slot keeping its keys, and
   ``balance_gap`` sized from the servers' slots when it is unset (``gap``);
5. without either: the balancer's pick (smooth weighted round-robin, least streams, or power
   of two choices by outstanding work: ``load.py``), then the other usable servers as
   fallbacks.

A request whose body names a LoRA adapter (in a group with load reports) has the order of
3 to 5 ranked again by ``lora.py``: servers holding the adapter first, then those with a free
adapter slot, then the least loaded, any server over its bound last.

New sessions (3 to 5) avoid a server whose engine reports its KV cache above the group's
``kv_cache_limit``: it comes last, unless every usable server is above it (then the limit
is ignored: better a busy cache than no answer). Admission (``max_streams``,
``max_waiting``) is not an order but a yes or no per server: ``has_room``; the exchange
walks the order for the first server with room and waits in ``queue`` when none has.

Backup servers appear only when no primary is usable (``health.usable_servers``).

Runtime server state (``RuntimeChanged``, ``config/runtime.py``), applied by
``apply_runtime`` to the very next decision; none of it moves or cuts a stream in flight,
which finishes on the server it started on:

- ``weight`` replaces the configured weight; 0 drains, as ``drain`` does;
- ``drain``: no new sessions (keys not remembered) and no unkeyed requests; a remembered key
  and a sticky cookie pinned to the server still go there while it is healthy;
- ``down``: nothing new at all, pinned and remembered keys included, as if unhealthy; they
  go where the hashing sends them and are remembered there.

"Takes existing sessions" (pins and remembered keys) means: not down, passive and active
health have it up, and it is not a backup while a primary is usable; a weight of 0 is fine.

Slow start (the group's ``slow_start``, as NGINX Plus's): a server that joins on a new
configuration (``reconfigure`` with ``now``: a discovered address, or one a reload added)
takes new sessions and unkeyed requests with a weight that ramps linearly from near 0 (a
thousandth of its own) to its own over ``slow_start`` seconds, so a cold engine is not handed
its whole share of conversations at once. Remembered and pinned sessions are not weighed, so
the ramp moves none of them. The ramp works on weights scaled by :data:`RAMP_SCALE` (the
balancers take integers; every balancer here depends only on the weights' ratios, so a group
with ``slow_start`` always routes on scaled weights, ramping or not, and the smooth
round-robin's cycle stays the same when a ramp ends). Servers of the first configuration do
not ramp: nothing was running on the others either.

A new configuration (``reconfigure``) keeps the state of every server whose address stays,
whatever is added, removed or reordered: passive and active health, the balancer's position,
streams in flight and the affinity memory (runtime overrides are re-applied by the core,
which holds them). Exchanges that began before it still hold the old router: their stream
counts and health reports are passed on to its successor for the servers that stayed, so
they finish without corrupting the new state; those of removed servers stay in the old one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

from muxproxy.config import AffinityMode, Balance, Upstream
from muxproxy.config.runtime import RuntimeState, ServerOverride
from muxproxy.config.serverid import server_id
from muxproxy.routing.admission import FairQueue
from muxproxy.routing.affinity import Affinity
from muxproxy.routing.balancer import (
    SmoothWeightedRoundRobin,
    least_streams,
    rendezvous_order,
)
from muxproxy.routing.health import ActiveHealth, PassiveHealth, usable_servers
from muxproxy.routing.kvplace import GroupKv
from muxproxy.routing.load import (
    Sampler,
    ServerLoads,
    Ticket,
    bounded_order,
    default_gap,
    power_of_two,
    within_bounds,
)
from muxproxy.routing.loadreport import LoadReport
from muxproxy.routing.lora import is_adapter, lora_order
from muxproxy.routing.ratelimit import Budget, RateLimiter

_NO_OVERRIDE = ServerOverride()
RAMP_SCALE = 1000
"""Routing weights of a group with ``slow_start`` are its weights times this: a ramp starts
at 1 (a thousandth of a weight of 1) and grows in steps of a thousandth."""
_NEVER = -math.inf


class GroupRouter:
    def __init__(self, group: Upstream, runtime: RuntimeState | None = None) -> None:
        self.group = group
        size = len(group.servers)
        self._index_servers(group)
        self.overrides = [_NO_OVERRIDE] * size
        """The operator's runtime overrides, per server (``apply_runtime``)."""
        self.weights = [s.weight for s in group.servers]
        """Routing weights: the override's weight or the configured one, 0 while draining."""
        self.down = [False] * size
        """Set down by the operator: nothing new goes there."""
        self.active = [0] * size
        """Streams in flight per server (``stream_started`` / ``stream_ended``)."""
        self.joined = [_NEVER] * size
        """When each server joined (``reconfigure``): its slow start runs from then."""
        self._ramp_end = _NEVER
        """When the last ramp ends: from then on, the scaled weights as they are."""
        self._scaled = [weight * RAMP_SCALE for weight in self.weights]
        """``weights`` times :data:`RAMP_SCALE` (a group with ``slow_start``)."""
        self.balancer = SmoothWeightedRoundRobin(size)
        self.passive = PassiveHealth(size)
        self.probes = ActiveHealth(size, group.health_check) if group.health_check else None
        self.affinity = Affinity(group.sticky.session_idle)
        self.loads = _loads(group)
        """Outstanding work and the engines' reports, per server (``load.py``)."""
        self.kv = _kv(group)
        """With ``kv_events``: the engines' KV-cache feeds and the tokens known
        (``kvplace.py``); None otherwise."""
        self.sampler = Sampler(int.from_bytes(hashlib.blake2b(group.name.encode()).digest()[:8]))
        self.queue: FairQueue[object] = FairQueue(group.queue.max)
        """Requests waiting for a server with room (admission control)."""
        self.limiter = _limiter(group)
        """Per-tenant budgets (``rate_limit``), or None."""
        self.share: RateLimiter | None = None
        """With a fleet store that cannot be reached: this replica's share of the budgets
        (``core/exchange/fleetadmit.py``), made on first use."""
        self.successor: GroupRouter | None = None
        """The router that replaced this one on a reload that changed the servers."""
        self._moved: list[int | None] = []
        """Per server here, its index in ``successor`` (None: removed)."""
        if runtime is not None:
            self.apply_runtime(runtime)

    def _index_servers(self, group: Upstream) -> None:
        secret = group.sticky.cookie.secret if group.sticky.cookie else ""
        self.ids = [server_id(group.name, s.address, secret) for s in group.servers]
        self.by_id = {sid: i for i, sid in enumerate(self.ids)}
        self.by_address = {s.address: i for i, s in enumerate(group.servers)}

    def apply_runtime(self, state: RuntimeState) -> None:
        """Use ``state``'s overrides for this group's servers from the next decision on;
        overrides of servers not in the group are ignored, servers without one get the
        configured weight back."""
        name = self.group.name
        for index, server in enumerate(self.group.servers):
            override = state.get(name, server.address)
            self.overrides[index] = override
            weight = server.weight if override.weight is None else override.weight
            self.weights[index] = 0 if override.drain else weight
            self.down[index] = override.down
        self._scaled = [weight * RAMP_SCALE for weight in self.weights]

    def routing_weights(self, now: float) -> Sequence[int]:
        """The weights new sessions and unkeyed requests are placed by now: ``weights``, or
        with ``slow_start`` the scaled ones, ramping for servers that joined recently."""
        ramp = self.group.slow_start
        if ramp <= 0:
            return self.weights
        if now >= self._ramp_end:
            return self._scaled
        out = list(self._scaled)
        for index, joined in enumerate(self.joined):
            elapsed = now - joined
            if elapsed < ramp and out[index] > 0:
                out[index] = max(1, int(out[index] * elapsed / ramp))
        return out

    def effective_weight(self, index: int, now: float) -> int | float:
        """The weight ``index`` is placed by now, in the units of its set weight (the
        weight itself without ``slow_start``)."""
        weight = self.routing_weights(now)[index]
        return round(weight / RAMP_SCALE, 3) if self.group.slow_start > 0 else weight

    def reconfigure(self, group: Upstream, now: float | None = None) -> GroupRouter:
        """The router for ``group``, a new configuration of this router's group.

        The state of each server whose address stays is kept (see the module header); a
        server new to the group joins at ``now`` (its slow start begins; None: no ramp).
        This router, updated, when the addresses are the same in the same order; otherwise
        a new router, and this one passes the in-flight accounting of kept servers on to it.
        Runtime overrides are dropped: the caller re-applies them (``apply_runtime``).
        """
        old = self.group
        self.affinity.idle = group.sticky.session_idle
        self.queue.limit = group.queue.max
        same_budget = old.rate_limit == group.rate_limit
        limiter = self.limiter if same_budget else _limiter(group)
        share = self.share if same_budget else None
        if [s.address for s in group.servers] == [s.address for s in old.servers]:
            self.group = group
            self._index_servers(group)
            self._ramp_end = max(self.joined, default=_NEVER) + group.slow_start
            loads = _loads(group)
            same = [(i, i) for i in range(len(group.servers))]
            loads.carry(self.loads, same)
            self.loads = loads
            self.kv = _kv(group, self.kv, same)
            self.limiter = limiter
            self.share = share
            self.apply_runtime(RuntimeState.empty())
            check = group.health_check
            if check is None:
                self.probes = None
            elif self.probes is None:
                self.probes = ActiveHealth(len(group.servers), check)
            else:
                self.probes.set_thresholds(check)
            return self
        new = GroupRouter(group)
        moved = [new.by_address.get(s.address) for s in old.servers]
        moves = [(before, after) for before, after in enumerate(moved) if after is not None]
        for before, after in moves:
            new.active[after] = self.active[before]
        if now is not None:
            kept = {after for _, after in moves}
            new.joined = [now if i not in kept else _NEVER for i in range(len(group.servers))]
        for before, after in moves:
            new.joined[after] = self.joined[before]
        new._ramp_end = max(new.joined, default=_NEVER) + group.slow_start
        new.passive.carry(self.passive, moves)
        new.balancer.carry(self.balancer, moves)
        if new.probes is not None and self.probes is not None:
            new.probes.carry(self.probes, moves)
        new.affinity = self.affinity  # keyed by address: still right for the kept servers
        new.loads.carry(self.loads, moves)
        new.kv = _kv(group, self.kv, moves)
        new.queue = self.queue  # the requests waiting go on waiting for the new servers
        new.limiter = limiter
        new.share = share
        self.successor = new
        self._moved = moved
        return new

    def _chain(self, index: int) -> list[tuple[GroupRouter, int]]:
        """``(router, index)`` of this server here and in every successor that kept it."""
        out = [(self, index)]
        router: GroupRouter = self
        while router.successor is not None:
            after = router._moved[index]
            if after is None:
                break
            router, index = router.successor, after
            out.append((router, index))
        return out

    # -- decisions -------------------------------------------------------------------------

    def candidates(
        self,
        key: bytes | None,
        pinned: bytes | None,
        now: float,
        prefix: bytes | None = None,
        model: str | None = None,
        conversation: Sequence[bytes] | None = None,
    ) -> list[int]:
        """Server indices to try, in order; empty when no server is usable. ``prefix``: the
        request's prefix key (used with ``affinity = "prefix"`` when there is no ``key``);
        ``model``: the model its body names (a LoRA adapter's name is placed by ``lora.py``
        in a group with load reports); ``conversation``: its message prefixes' keys, with
        ``kv_events`` (the engines' caches reorder the prefix key's order: ``kvplace.py``)."""
        out: list[int] = []
        pin = None if pinned is None else self.by_id.get(pinned)
        known = None
        if key is not None:
            address = self.affinity.lookup(key, now)
            if address is not None:
                known = self.by_address.get(address)
        if pin is not None and self._takes_existing(pin, now):
            out.append(pin)
        if known is not None and known != pin and self._takes_existing(known, now):
            out.append(known)
        usable = self._usable(now, for_new_sessions=True)
        group = self.group
        weights = self.routing_weights(now)
        report = group.load_report
        fresh = usable
        if report is not None:
            fresh = [i for i in usable if not self.loads.kv_full(i, report.kv_cache_limit, now)]
            fresh = fresh or usable
        if key is not None:
            ranked = rendezvous_order(key, self.ids, weights, fresh)
        elif prefix is not None and group.affinity is AffinityMode.PREFIX:
            free, gap, factor = self._free_at(now), self.gap(), group.prefix.load_factor
            ranked = bounded_order(prefix, self.ids, weights, self.active, fresh, factor, gap, free)
            if conversation is not None and self.kv is not None:
                bound = within_bounds(weights, self.active, ranked, factor, gap)
                ranked = self.kv.order(
                    ranked,
                    conversation,
                    now,
                    self.active,
                    weights,
                    lambda i: free(i) is True or bound(i),
                )
        else:
            balance = group.balance
            if balance is Balance.LEAST_LOAD:
                pick = power_of_two(weights, self._work_at(now), fresh, self.sampler)
            elif balance is Balance.LEAST_STREAMS:
                pick = least_streams(weights, self.active, fresh, self.balancer)
            else:
                pick = self.balancer.pick(weights, fresh)
            ranked = []
            if pick is not None:
                # Fallbacks: the others, in order after the pick, so retries spread too.
                at = fresh.index(pick)
                ranked = fresh[at:] + fresh[:at]
        if model is not None and report is not None and len(ranked) > 1:
            ranked = self._lora_order(model, ranked, weights, now)
        out.extend(i for i in ranked if i not in out)
        if len(fresh) < len(usable):
            out.extend(i for i in usable if i not in out)  # above the KV-cache limit: last
        return out

    def _lora_order(
        self, model: str, ranked: list[int], weights: Sequence[int], now: float
    ) -> list[int]:
        """``ranked`` for a request naming ``model``: by ``lora.lora_order`` if it is a LoRA
        adapter, as it is otherwise (the base model)."""
        loads = self.loads
        reports = [loads.fresh(index, now) for index in range(len(self.group.servers))]
        loras = [None if r is None else r.lora for r in reports]
        bases = (r.models for r in reports if r is not None)
        if any(weights[index] <= 0 for index in ranked) or not is_adapter(model, loras, bases):
            return ranked
        bound = within_bounds(
            weights, self.active, ranked, self.group.prefix.load_factor, self.gap()
        )
        work = self._work_at(now)
        return lora_order(
            model,
            ranked,
            loras,
            lambda index: self.has_room(index, now) and bound(index),
            lambda index: work(index) / weights[index],
        )

    def gap(self) -> int:
        """``prefix.balance_gap``, else sized from the servers' slots (``load.default_gap``)."""
        gap = self.group.prefix.balance_gap
        if gap is not None:
            return gap
        loads = self.loads
        servers = self.group.servers
        return default_gap(loads.slots(i, server.max_streams) for i, server in enumerate(servers))

    def _free_at(self, now: float) -> Callable[[int], bool | None]:
        loads, active, servers = self.loads, self.active, self.group.servers
        return lambda index: loads.free(index, active[index], servers[index].max_streams, now)

    def _work_at(self, now: float) -> Callable[[int], int]:
        loads, active = self.loads, self.active
        return lambda index: loads.work(index, active[index], now)

    def has_room(self, index: int, now: float) -> bool:
        """Whether ``index`` may take one more stream (``max_streams``, ``max_waiting``)."""
        server = self.group.servers[index]
        limit = server.max_streams
        if limit is not None and self.active[index] >= limit:
            return False
        limit = server.max_waiting
        if limit is not None:
            waiting = self.loads.waiting(index, now)
            if waiting is not None and waiting >= limit:
                return False
        return True

    def rooms(self, now: float) -> set[str]:
        """The addresses of the servers that take new sessions and have room (where the
        queue may admit)."""
        servers = self.group.servers
        usable = self._usable(now, for_new_sessions=True)
        return {servers[index].address for index in usable if self.has_room(index, now)}

    def _usable(self, now: float, *, for_new_sessions: bool) -> list[int]:
        """``health.usable_servers`` with this group's state."""
        return usable_servers(
            self.group.servers,
            self.weights,
            self.passive,
            self.probes,
            now,
            for_new_sessions=for_new_sessions,
            down=self.down,
        )

    def load_reported(self, index: int, report: LoadReport, now: float) -> None:
        """The engine of ``index`` reported its load (``core/upstream/loadpoll.py``)."""
        self.loads.report(index, report, now, self.active[index])

    def _takes_existing(self, index: int, now: float) -> bool:
        """Whether pins and remembered keys may go to ``index`` now: not down, healthy, and
        not a backup while a primary is usable (``usable_servers(for_new_sessions=False)``,
        without building the list for a primary)."""
        if self.down[index] or not self.passive.usable(index, now):
            return False
        if self.probes is not None and not self.probes.up(index):
            return False
        if not self.group.servers[index].backup:
            return True
        return index in self._usable(now, for_new_sessions=False)

    # -- what happened ---------------------------------------------------------------------

    def stream_started(
        self, index: int, key: bytes | None, now: float, ticket: Ticket | None = None
    ) -> None:
        """A request is sent to ``index``: one more stream in flight there, with its expected
        work (``ticket``); with a session key, remember that it went there."""
        if self.successor is None:
            self.active[index] += 1
            if ticket is not None:
                self.loads.add(index, ticket)
        else:
            for router, at in self._chain(index):
                router.active[at] += 1
                if ticket is not None:
                    router.loads.add(at, ticket)
        if key is not None:
            self.affinity.sent(key, self.group.servers[index].address, now)

    def stream_ended(self, index: int, ticket: Ticket | None = None) -> None:
        """A stream ``stream_started`` counted has left ``index`` (done, failed, moved on)."""
        if self.successor is None:
            self.active[index] -= 1
            if ticket is not None:
                self.loads.remove(index, ticket)
        else:
            for router, at in self._chain(index):
                router.active[at] -= 1
                if ticket is not None:
                    router.loads.remove(at, ticket)

    def failed(self, index: int, now: float) -> bool:
        """A connection error or timeout on ``index``; True when it took the server out.

        As in nginx, a group of one server never takes it out on failures: there is nothing
        to fail over to, and answering 503 instead of trying would only add errors.
        """
        took_out = False
        for router, at in self._chain(index):
            if len(router.group.servers) > 1:
                took_out = router.passive.failure(at, now, router.group.servers[at]) or took_out
        return took_out

    def succeeded(self, index: int) -> None:
        for router, at in self._chain(index):
            router.passive.success(at)

    def probe_result(self, index: int, ok: bool) -> bool:
        """An active health check's result; True when the server's state changed."""
        return self.probes.result(index, ok) if self.probes else False

    # -- introspection ---------------------------------------------------------------------

    def healthy(self, index: int, now: float) -> bool:
        """Passive and active health have the server up (the operator's ``down`` aside)."""
        if not self.passive.usable(index, now):
            return False
        return self.probes is None or self.probes.up(index)

    def status(self, now: float) -> dict[str, object]:
        """This group's part of ``ProxyCore.status()`` (JSON-able)."""
        servers = []
        for index, server in enumerate(self.group.servers):
            override = self.overrides[index]
            weight = server.weight if override.weight is None else override.weight
            healthy = self.healthy(index, now)
            if override.down or not healthy:
                state = "down"
            elif override.drain or weight <= 0:
                state = "draining"
            else:
                state = "up"
            servers.append(
                {
                    "address": server.address,
                    "id": self.ids[index].decode("ascii"),
                    "weight": weight,
                    "effective_weight": self.effective_weight(index, now),
                    "configured_weight": server.weight,
                    "state": state,
                    "health": "healthy" if healthy else "unhealthy",
                    "active": self.active[index],
                    "failures": self.passive.failures(index, now, server),
                    "max_streams": server.max_streams,
                    "work": self.loads.own_work(index),
                    "reported": self._reported(index, now),
                }
            )
            if self.kv is not None:
                servers[-1]["kv_events"] = self.kv.status(index, now, self.active[index] > 0)
        group = self.group
        out: dict[str, object] = {
            "balance": group.balance.value,
            "affinity": group.affinity.value,
            "servers": servers,
            "queue": {"waiting": len(self.queue), "max": group.queue.max},
            "remembered_sessions": len(self.affinity),
        }
        if self.limiter is not None:
            out["rate_limited_tenants"] = len(self.limiter)
        if self.kv is not None:
            out["kv_events"] = self.kv.group_status()
        return out

    def _reported(self, index: int, now: float) -> dict[str, object] | None:
        entry = self.loads.reports[index]
        if entry is None:
            return None
        report, at = entry
        out: dict[str, object] = {
            "running": report.running,
            "waiting": report.waiting,
            "kv_cache": report.kv_cache,
            "age": round(now - at, 3),
            "fresh": self.loads.fresh(index, now) is not None,
        }
        if report.lora is not None:
            out["lora_adapters"] = sorted(report.lora.loaded)
            out["max_lora"] = report.lora.max_lora
        return out


def _loads(group: Upstream) -> ServerLoads:
    interval = group.load_report.interval if group.load_report is not None else None
    return ServerLoads(len(group.servers), group.default_max_tokens, interval)


def _kv(
    group: Upstream, old: GroupKv | None = None, moves: Sequence[tuple[int, int]] = ()
) -> GroupKv | None:
    """The KV-event state of ``group`` (None without ``kv_events``), keeping ``old``'s for
    the servers that ``moves`` maps."""
    if group.kv_events is None:
        return None
    kv = GroupKv.of(group.kv_events, len(group.servers))
    if old is not None:
        kv.carry(old, moves)
    return kv


def _limiter(group: Upstream) -> RateLimiter | None:
    budget = group.rate_limit
    if budget is None:
        return None
    return RateLimiter(
        Budget(
            tokens_per_minute=budget.tokens_per_minute,
            requests_per_minute=budget.requests_per_minute,
            max_concurrent=budget.max_concurrent,
        )
    )
