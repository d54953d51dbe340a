"""What ``muxproxy check`` prints of a valid configuration: one line per listener, group and
route, with what each does beyond the defaults.

Never a secret: an admin token is "set", a store URL is shown without its password, and set
headers by their names only (their values may hold credentials), since the summary may be
pasted into a ticket.
"""

from __future__ import annotations

import attrs

from muxproxy.config import (
    AffinityMode,
    Config,
    GroupTimeouts,
    Listener,
    Route,
    Server,
    Upstream,
)
from muxproxy.config.storeurl import redacted
from muxproxy.extensions.api import HOOKS, defines
from muxproxy.process.common import scheme

__all__ = ["describe_config", "seconds"]


def _describe_trust(listener: Listener) -> str:
    """Whose forwarded fields the listener believes (``trusted_proxies``); nothing when
    nobody's (the default)."""
    if not listener.trusted_proxies:
        return ""
    return f" (forwarded fields trusted from {', '.join(map(str, listener.trusted_proxies))})"


def describe_config(config: Config) -> list[str]:
    """A short summary of ``config``: its listeners, upstream groups, routes and stop grace.

    A group's settings follow it on indented lines: balancing and retries always, stickiness,
    health checks, set headers (names only: values may hold credentials) and timeouts when
    configured; a route's retries until the first event, resume and continuation follow it
    in parentheses.
    """
    lines = [
        f"listener {scheme(listener.tls)}://{listener.address}{_describe_trust(listener)}"
        for listener in config.listeners
    ]
    for name, group in config.upstreams.items():
        lines.append(f"upstream {name}: {_describe_servers(group)}")
        lines.extend(f"  {line}" for line in _describe_group(group))
    for route in config.routes:
        notes = _describe_route(route)
        extra = f" ({'; '.join(notes)})" if notes else ""
        lines.append(f"route {route.prefix} -> {route.upstream}{extra}")
    log = config.log
    access = "off" if log.access == "off" else f"{log.access} ({log.format})"
    lines.append(f"log: access {access}, error log level {log.level}")
    grace = seconds(config.timeouts.shutdown_grace)
    lines.append(f"graceful stop: streams get {grace} to finish (timeouts.shutdown_grace)")
    if any(group.discover is not None for group in config.upstreams.values()):
        resolver = config.resolver
        where = ", ".join(resolver.nameservers) or "the system's nameservers"
        lines.append(
            f"resolver: {where} (timeout {seconds(resolver.timeout)},"
            f" {resolver.attempts} attempt{'s' if resolver.attempts != 1 else ''})"
        )
    for extension in config.extensions:
        hooks = [hook for hook in HOOKS if defines(extension.instance, hook)]
        lines.append(
            f"extension {extension.module}: {', '.join(hooks) or 'no hooks'} (async timeout"
            f" {seconds(extension.timeout)}, on error {extension.on_error.value})"
        )
    fleet = config.fleet
    if fleet is not None:
        lines.append(
            f"fleet: runtime state, session memory and budgets shared through"
            f" {redacted(fleet.store)} (reconciled every {seconds(fleet.sync_interval)};"
            f" budgets while it is down: {fleet.on_store_error.value})"
        )
    admin = config.admin
    if admin is not None:
        # Never the token itself: the summary may be pasted into a ticket.
        guard = "token set" if admin.token is not None else "no token: read-only"
        state = f", state file {admin.state_file}" if admin.state_file is not None else ""
        lines.append(f"admin http://{admin.address} ({guard}{state})")
    return lines


def _describe_route(route: Route) -> list[str]:
    """What a route does beyond routing: first-event retries, resume, continuation (a store
    URL without its credentials)."""
    notes = []
    if route.retry_until_first_event:
        notes.append("retry until first event")
    resume = route.resume
    if resume is not None:
        store = "this process" if resume.store is None else redacted(resume.store)
        notes.append(
            f"resume: {resume.window // 1024} KiB of events for {resume.linger:g}s, in {store}"
        )
    if route.continue_on_failure:
        notes.append("continue on failure")
    return notes


def _describe_servers(group: Upstream) -> str:
    """The group's servers, or where it discovers them."""
    found = group.discover
    if found is None:
        count = len(group.servers)
        servers = ", ".join(_describe_server(server) for server in group.servers)
        return f"{count} server{'s' if count != 1 else ''} ({servers})"
    records = f"A/AAAA records of {found.dns}, port {found.port}" if found.dns else None
    text = f"servers from DNS: {records or f'SRV records of {found.srv}'}"
    text += f", looked up every {seconds(found.interval)} (or the TTL, if shorter)"
    if group.slow_start:
        text += f"; new servers ramp in over {seconds(group.slow_start)}"
    return text


def _describe_server(server: Server) -> str:
    text = server.address
    default = Server(address=server.address)
    if server.weight != default.weight:
        text += f" weight={server.weight}" + (" (draining)" if server.weight == 0 else "")
    if server.max_fails != default.max_fails:
        text += f" max_fails={server.max_fails}"
    if server.fail_timeout != default.fail_timeout:
        text += f" fail_timeout={seconds(server.fail_timeout)}"
    if server.backup:
        text += " backup"
    if server.max_streams is not None:
        text += f" max_streams={server.max_streams}"
    if server.max_waiting is not None:
        text += f" max_waiting={server.max_waiting}"
    return text


def _describe_llm(group: Upstream) -> list[str]:
    """The lines of LLM-aware balancing and admission, for a group that uses them."""
    lines = []
    if group.affinity is AffinityMode.PREFIX:
        prefix = group.prefix
        gap = prefix.balance_gap
        lines.append(
            f"prefix affinity on the first {_size(prefix.length)} of {prefix.source} prompts,"
            f" bounded at {prefix.load_factor:g} x the mean load"
            + " and "
            + ("a quarter of the servers' slots" if gap is None else f"{gap} streams")
            + " over the least loaded server"
        )
    events = group.kv_events
    if events is not None:
        own = sum(server.kv_events is not None for server in group.servers)
        lines.append(
            f"placed by the engines' KV-cache events on port {events.port}"
            + (f" ({own} at their own endpoint)" if own else "")
            + f', topic "{events.topic}", untrusted after {seconds(events.stale_after)}'
            " silent while busy"
        )
    report = group.load_report
    if report is not None:
        lines.append(
            f"load reports GET {report.path} every {seconds(report.interval)}"
            f" (stale after {seconds(3 * report.interval)}; no new sessions above"
            f" {report.kv_cache_limit:.0%} KV cache)"
        )
    if group.admission:
        queue = group.queue
        classes = "".join(f", class {level}: {seconds(wait)}" for level, wait in queue.max_wait)
        lines.append(
            f"admission queue of {queue.max}, {seconds(queue.timeout)} at most{classes}, then"
            f" 429 (Retry-After {queue.retry_after}s)"
        )
    budget = group.rate_limit
    if budget is not None:
        limits = [
            f"{value} {name} a minute"
            for name, value in (
                ("tokens", budget.tokens_per_minute),
                ("requests", budget.requests_per_minute),
            )
            if value is not None
        ]
        lines.append("budget per tenant: " + ", ".join(limits))
    who = [
        f"{name} by {source.kind}:{source.name}"
        for name, source in (("tenant", group.tenant), ("priority", group.priority))
        if source is not None
    ]
    if who:
        lines.append("; ".join(who))
    return lines


def _describe_group(group: Upstream) -> list[str]:
    retry = group.next_upstream
    if retry.on and retry.tries > 1:
        conditions = sorted(retry.on, key=lambda c: (c.startswith("http_"), c))
        replay = (
            f"bodies up to {_size(retry.replay_buffer)}"
            if retry.replay_buffer
            else "bodies not replayed"
        )
        retries = (
            f"retry on {', '.join(conditions)}: {retry.tries} tries within"
            f" {seconds(retry.tries_timeout)}, {replay}"
        )
    else:
        retries = "no retries"
    lines = [f"balance {group.balance.value}; {retries}"]
    sticky = group.sticky
    parts = []
    if sticky.sources:
        parts.append("by " + ", ".join(f"{src.kind}:{src.name}" for src in sticky.sources))
    if sticky.cookie is not None:
        expires = sticky.cookie.expires
        lifetime = "session" if expires is None else seconds(expires)
        parts.append(f"cookie {sticky.cookie.name} ({lifetime})")
    if parts:
        lines.append("sticky " + "; ".join(parts))
    health = group.health_check
    if health is not None:
        lines.append(
            f"health check GET {health.path} every {seconds(health.interval)}"
            f" (timeout {seconds(health.timeout)}, expect {health.expect_status},"
            f" up after {health.passes}, down after {health.fails})"
        )
    lines.extend(_describe_llm(group))
    if group.set_headers:
        lines.append("set headers " + ", ".join(rule.name for rule in group.set_headers))
    timeouts = [
        f"{field.name} {seconds(value)}"
        for field in attrs.fields(GroupTimeouts)
        if (value := getattr(group.timeouts, field.name)) is not None
    ]
    if timeouts:
        lines.append("timeouts " + ", ".join(timeouts))
    return lines


def _size(value: int) -> str:
    for unit, size in (("MiB", 1024 * 1024), ("KiB", 1024)):
        if value % size == 0:
            return f"{value // size} {unit}"
    return f"{value} bytes"


def seconds(value: float) -> str:
    return f"{value:g}s"
