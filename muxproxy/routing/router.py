"""The runtime routing state of one upstream group, and its one question: which servers, in
what order, for this request?

Pure: time comes in as ``now``, nothing here does I/O, and two processes built from the same
configuration give the same answers for the same keys (rendezvous hashing over stable server
ids). The order it returns is the order the exchange tries on failure:

1. a pinned server (named by a sticky cookie) while it is up — also while it drains
   (weight 0), so ongoing conversations stay where their KV cache is;
2. with a session key: weighted rendezvous hashing over the usable servers with weight > 0;
3. without one: the balancer's pick (smooth weighted round-robin or least streams), then the
   other usable servers as fallbacks.

Backup servers appear only when no primary is usable (``health.usable_servers``).

A new configuration keeps a group's state while its servers stay the same — the same
addresses in the same order, since all state is kept by position (``reconfigure``): health,
the balancer's position, streams in flight, and runtime weights (a weight the operator changed
stays until the configuration changes that server's weight itself).
"""

from __future__ import annotations

from ..config import Balance, Upstream
from .balancer import SmoothWeightedRoundRobin, least_streams, rendezvous_order, server_id
from .health import ActiveHealth, PassiveHealth, usable_servers


class GroupRouter:
    def __init__(self, group: Upstream) -> None:
        self.group = group
        size = len(group.servers)
        secret = group.sticky.cookie.secret if group.sticky.cookie else ""
        self.ids = [server_id(group.name, s.address, secret) for s in group.servers]
        self.by_id = {sid: i for i, sid in enumerate(self.ids)}
        self.weights = [s.weight for s in group.servers]
        """Runtime weights: start from the configuration, changed by operators (drain: 0)."""
        self.active = [0] * size
        """Streams in flight per server."""
        self.balancer = SmoothWeightedRoundRobin(size)
        self.passive = PassiveHealth(size)
        self.probes = ActiveHealth(size, group.health_check) if group.health_check else None

    def reconfigure(self, group: Upstream) -> GroupRouter:
        """The router for ``group``, a new configuration of this router's group.

        This router, updated, when ``group`` lists the same server addresses in the same
        order: passive and active health, balancer state and streams in flight carry over,
        so do runtime weights except where the configured weight changed; new health-check
        thresholds apply to the current up/down state. Otherwise a new router: positions
        name other servers now.
        """
        old = self.group
        if [s.address for s in group.servers] != [s.address for s in old.servers]:
            return GroupRouter(group)
        self.group = group
        secret = group.sticky.cookie.secret if group.sticky.cookie else ""
        self.ids = [server_id(group.name, s.address, secret) for s in group.servers]
        self.by_id = {sid: i for i, sid in enumerate(self.ids)}
        for index, (before, after) in enumerate(zip(old.servers, group.servers, strict=True)):
            if after.weight != before.weight:
                self.weights[index] = after.weight
        check = group.health_check
        if check is None:
            self.probes = None
        elif self.probes is None:
            self.probes = ActiveHealth(len(group.servers), check)
        else:
            self.probes.set_thresholds(check)
        return self

    def candidates(self, key: bytes | None, pinned: bytes | None, now: float) -> list[int]:
        """Server indices to try, in order; empty when no server is usable."""
        servers = self.group.servers
        out: list[int] = []
        if pinned is not None:
            index = self.by_id.get(pinned)
            if index is not None and index in usable_servers(
                servers, self.weights, self.passive, self.probes, now, for_new_sessions=False
            ):
                out.append(index)
        usable = usable_servers(
            servers, self.weights, self.passive, self.probes, now, for_new_sessions=True
        )
        if key is not None:
            ranked = rendezvous_order(key, self.ids, self.weights, usable)
        else:
            if self.group.balance is Balance.LEAST_STREAMS:
                first = least_streams(self.weights, self.active, usable, self.balancer)
            else:
                first = self.balancer.pick(self.weights, usable)
            ranked = []
            if first is not None:
                # Fallbacks: the others, in order after the pick, so retries spread too.
                at = usable.index(first)
                ranked = usable[at:] + usable[:at]
        out.extend(i for i in ranked if i not in out)
        return out

    def failed(self, index: int, now: float) -> bool:
        """A connection error or timeout on ``index``; True when it took the server out.

        As in nginx, a group of one server never takes it out on failures: there is nothing
        to fail over to, and answering 503 instead of trying would only add errors.
        """
        if len(self.group.servers) == 1:
            return False
        return self.passive.failure(index, now, self.group.servers[index])

    def succeeded(self, index: int) -> None:
        self.passive.success(index)

    def probe_result(self, index: int, ok: bool) -> bool:
        """An active health check's result; True when the server's state changed."""
        return self.probes.result(index, ok) if self.probes else False
