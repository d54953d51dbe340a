"""The engines' KV-cache events and tokens, as the core takes them in: which endpoints the
driver follows, what each message does to its server's feed, and the tokenize answers.

What it obeys: the core's rules (no clock but ``Effects.now``, no I/O). The driver follows
the endpoints a configuration names (``KvFollow``, emitted on every configuration that has
or had a group with ``kv_events``) and hands back each subscription's state
(``KvSubscription``) and message (``KvEventsReceived``), as the load polls hand their reports
to the router; the feeds are the routers' (``routing/kvplace.py``), so a new configuration
keeps those of the servers that stay. A message for a group or server no longer configured
is dropped: its subscription is on its way out.

Tokens (``routing/kvtokens.py``): a request placed with a conversation asks, after its
placement, for its own prompt's tokens from the server it goes to (:func:`ask_tokens`,
``KvTokenize``), for its next turn; the answer (``KvTokensAnswered``) is read here. A
failing ``/tokenize`` degrades this feature alone: requests go by the prefix key; its
failing and recovering are logged (``kv_tokenize``), not every failure. A message the feed
refuses, or a sequence gap, is logged (``kv_events``) at most once per :data:`LOG_INTERVAL`
per server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from muxproxy.config import Config, Upstream
from muxproxy.config.kvevents import endpoint_host_port
from muxproxy.core.commands import KvEndpoint, KvFollow, KvTokenize, Log, Origin
from muxproxy.core.effects import Effects
from muxproxy.core.events import Event, KvEventsReceived, KvSubscription, KvTokensAnswered
from muxproxy.routing.kvfeed import EngineFeed
from muxproxy.routing.kvtokens import TokenizeError, parse_tokenize_answer, tokenize_body
from muxproxy.routing.router import GroupRouter

__all__ = ["LOG_INTERVAL", "KvFeeds", "ask_tokens", "endpoints"]

LOG_INTERVAL = 60.0
"""Seconds between two logged notes (refused messages, gaps) of one server's feed."""


def endpoints(config: Config) -> Iterator[KvEndpoint]:
    """Where each server of each group with ``kv_events`` publishes: its own ``kv_events``
    endpoint, else the group's port on the server's host."""
    for name, group in config.upstreams.items():
        settings = group.kv_events
        if settings is None:
            continue
        topic = settings.topic.encode()
        for server in group.servers:
            if server.kv_events is not None:
                host, port = endpoint_host_port(server.kv_events)
            else:
                host, port = server.host, settings.port
            yield KvEndpoint(group=name, address=server.address, host=host, port=port, topic=topic)


def ask_tokens(
    fx: Effects,
    router: GroupRouter,
    index: int,
    conversation: Sequence[bytes],
    document: Mapping[str, object],
) -> None:
    """A request of ``conversation`` (its body: ``document``) was placed on server ``index``:
    ask that engine for its prompt's tokens unless known or asked already."""
    kv = router.kv
    if kv is None:
        return
    key = kv.ask(conversation)
    if key is not None:
        origin = Origin.of(router.group.servers[index])
        body = tokenize_body(document)
        fx.emit(KvTokenize(group=router.group.name, origin=origin, key=key, body=body))


class KvFeeds:
    """The core's side of every group's KV-cache events (see the module header)."""

    def __init__(self, fx: Effects, router: Callable[[Upstream], GroupRouter]) -> None:
        self.fx = fx
        self.router = router
        self._following = False
        """The last ``KvFollow`` named some endpoint (a configuration without any must say
        so, to stop them)."""
        self._noted: dict[tuple[str, str], float] = {}
        """When a note of each (group, server) was last logged."""

    def handlers(self) -> dict[type[Event], Callable[[Any], None]]:
        """The core's dispatch entries of the events this part takes."""
        return {
            KvSubscription: self.subscription,
            KvEventsReceived: self.received,
            KvTokensAnswered: self.answered,
        }

    def configured(self) -> None:
        """A configuration is in force: tell the driver what to follow."""
        wanted = tuple(endpoints(self.fx.config))
        if wanted or self._following:
            self.fx.emit(KvFollow(endpoints=wanted))
        self._following = bool(wanted)

    def _router(self, name: str) -> GroupRouter | None:
        group = self.fx.config.upstreams.get(name)
        if group is None or group.kv_events is None:
            return None
        return self.router(group)

    def _feed(self, name: str, address: str) -> EngineFeed | None:
        router = self._router(name)
        if router is None or router.kv is None:
            return None
        index = router.by_address.get(address)
        return None if index is None else router.kv.feeds[index]

    def subscription(self, event: KvSubscription) -> None:
        feed = self._feed(event.group, event.address)
        if feed is None:
            return
        if event.error:
            feed.failed(event.error)
        else:
            feed.up(event.now)

    def received(self, event: KvEventsReceived) -> None:
        feed = self._feed(event.group, event.address)
        if feed is None:
            return
        now = event.now
        note = feed.message(list(event.parts), now)
        if note is None:
            return
        where = (event.group, event.address)
        if now - self._noted.get(where, -LOG_INTERVAL) >= LOG_INTERVAL:
            self._noted[where] = now
            fields = {"upstream": event.group, "server": event.address, "detail": note}
            self.fx.emit(Log(event="kv_events", fields=fields))

    def answered(self, event: KvTokensAnswered) -> None:
        router = self._router(event.group)
        if router is None or router.kv is None:
            return
        tokens = None
        error = event.error
        if event.body is not None:
            try:
                tokens = parse_tokenize_answer(event.body)
            except TokenizeError as exc:
                error = str(exc)
        if router.kv.answered(event.key, tokens, error):
            fields = {"upstream": event.group, "ok": tokens is not None, "detail": error or "ok"}
            self.fx.emit(Log(event="kv_tokenize", fields=fields))
