"""An exchange's extension hooks (``muxproxy.extensions``): when each runs, and what its answer
does to the exchange.

What it obeys, and why:

- **Nothing without extensions.** An exchange has ``hooks`` (an ``ExchangeHooks``) only when
  the configuration names extensions; every call site tests ``exchange.hooks is not None``
  and the per-chunk path tests nothing (SSE events reach the hooks through ``EventTap``, the
  meter such a stream gets instead of the plain ``SseMeter``).
- **Configuration order; the first answer wins.** ``on_request_head`` runs once the route is
  found (before the body is read, budgets reserved or a server chosen), each extension's sync
  hook then its async one; an answer ends the request, a rewrite is seen by the next
  extension. ``choose_server`` runs on every placement (the first try, a retry to the next
  server, an admission from the queue) with the servers not tried yet: the first extension
  that names one of them makes it the next try. (A continuation of a broken stream and the
  stale retry, on the same server, are not placements.)
- **The async hook is the driver's.** The exchange emits ``ExtensionCall`` and waits in
  AWAITING_HOOK; the driver awaits the hook under the extension's ``timeout`` and feeds
  ``ExtensionAnswered`` (the fleet budgets' RESERVING is the precedent). A client that leaves
  meanwhile ends the exchange (the table takes its abort there); a late answer finds it gone.
- **An extension's failure is its own.** A hook that raises, times out or answers what it may
  not (an unknown group, a server that is no candidate, a status outside 400..599) is
  counted (``extension_errors``), logged at most once per ``LOG_EVERY`` seconds per
  extension and hook, and handled by the extension's ``on_error``: ``reject`` answers 503
  (502 for a response head: the backend answered), ``continue`` goes on as if the hook
  returned nothing. Hooks that only observe (``on_sse_event``, ``on_finish``) go on either
  way. The broad ``except Exception`` below is deliberate: extension code is foreign, and its
  exception leaves no state of ours unknown (nothing of the exchange changed during the call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from muxproxy.config.extensions import ExtensionConfig, HookErrorPolicy
from muxproxy.core.commands import ExtensionCall, Log
from muxproxy.core.events import ExtensionAnswered
from muxproxy.core.exchange.admit import UsageScan, tenant_of
from muxproxy.core.exchange.body import RequestBody
from muxproxy.core.exchange.exchange_states import ExchangeInput
from muxproxy.core.exchange.exchangeports import Routed
from muxproxy.core.messages import AnswerRewrite, Headers
from muxproxy.core.observe.series import TokenTimes
from muxproxy.core.observe.ssemeter import SseMeter, is_token_event
from muxproxy.core.ports import ClientPeer
from muxproxy.extensions.api import Decision, HeaderRewrite, Outcome, Request, Response, defines

if TYPE_CHECKING:
    from muxproxy.core.exchange.failover import Failover
    from muxproxy.core.messages import ResponseHead

__all__ = ["LOG_EVERY", "OWN_FRAMING", "EventTap", "ExchangeHooks", "Hooked"]

LOG_EVERY = 10.0
"""Seconds between two ``extension_error`` lines of one extension's hook (the rest counted)."""

OWN_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})
"""Fields of the proxy's own answer that frame its body: an extension cannot rewrite them."""

_I = ExchangeInput
_FAILED: Any = object()
"""What ``_call`` returns for a hook that failed."""


class Hooked(Routed, Protocol):
    """The exchange as its hooks see it."""

    hooks: ExchangeHooks | None
    response: ResponseHead | None
    status: int
    bytes_out: int
    bytes_in: int
    started: float
    outcome: str
    usage: UsageScan | None
    meter: SseMeter | None

    @property
    def server_address(self) -> str: ...
    @property
    def client(self) -> ClientPeer: ...


@attrs.frozen
class Chain:
    """A configuration's extensions, with the hooks each defines (found once per
    configuration)."""

    extensions: tuple[ExtensionConfig, ...]
    head: tuple[int, ...]
    servers: tuple[int, ...]
    response: tuple[int, ...]
    events: tuple[int, ...]
    finish: tuple[int, ...]
    waits: frozenset[int]
    """Those with ``on_request_head_async``."""

    @classmethod
    def of(cls, extensions: tuple[ExtensionConfig, ...]) -> Chain:
        def having(hook: str) -> tuple[int, ...]:
            return tuple(i for i, e in enumerate(extensions) if defines(e.instance, hook))

        return cls(
            extensions=extensions,
            head=tuple(sorted({*having("on_request_head"), *having("on_request_head_async")})),
            servers=having("choose_server"),
            response=having("on_response_head"),
            events=having("on_sse_event"),
            finish=having("on_finish"),
            waits=frozenset(having("on_request_head_async")),
        )


_chain: Chain | None = None


def chain_of(extensions: tuple[ExtensionConfig, ...]) -> Chain:
    """The chain of a configuration's extensions (the last one's kept: one per reload)."""
    global _chain
    if _chain is None or _chain.extensions is not extensions:
        _chain = Chain.of(extensions)
    return _chain


class ExchangeHooks:
    """One exchange's extensions: the view they see, and what they decided so far."""

    __slots__ = ("chain", "exchange", "tenant", "view")

    def __init__(self, extensions: tuple[ExtensionConfig, ...], exchange: Hooked) -> None:
        self.chain = chain_of(extensions)
        self.exchange = exchange
        self.view: Request | None = None
        self.tenant: int | None = None
        """The tenant an extension set (hashed as ``admit.tenant_of`` does)."""

    @property
    def chooses(self) -> bool:
        return bool(self.chain.servers)

    # -- the request head ------------------------------------------------------------------

    def request_head(self, exchange: Hooked) -> bool:
        """Run the request-head hooks; True: routing goes on now; False: answered, or an
        async hook runs (AWAITING_HOOK)."""
        self.view = _view(exchange)
        return self._run(exchange, 0, sync=True)

    def _run(self, exchange: Hooked, position: int, *, sync: bool) -> bool:
        chain = self.chain
        for at in range(position, len(chain.head)):
            index = chain.head[at]
            config = chain.extensions[index]
            extension = config.instance
            if sync and defines(extension, "on_request_head"):
                view = self.view
                assert view is not None
                decision = _call(exchange, config, "on_request_head", view)
                if not self._decided(exchange, config, decision, "on_request_head"):
                    return False
            sync = True
            if index in chain.waits:
                exchange.move(_I.AWAIT_HOOK)
                assert self.view is not None
                exchange.fx.emit(
                    ExtensionCall(
                        request=exchange.ident,
                        position=at,
                        extension=extension,
                        view=self.view,
                        timeout=config.timeout,
                    )
                )
                return False
        return True

    def answered(self, exchange: Hooked, event: ExtensionAnswered) -> bool:
        """AWAITING_HOOK: the driver's answer of an async hook; True: routing goes on now."""
        if not exchange.move(_I.HOOK_ANSWERED):
            return False
        config = self.chain.extensions[self.chain.head[event.position]]
        hook = "on_request_head_async"
        decision = event.decision
        if event.error:
            decision = _failed(exchange, config, hook, event.error)
        if not self._decided(exchange, config, decision, hook):
            return False
        exchange.move(_I.HOOKED)
        return self._run(exchange, event.position + 1, sync=False)

    def _decided(self, exchange: Hooked, config: ExtensionConfig, decision: Any, hook: str) -> bool:
        """Apply a request-head hook's ``decision``; False: the exchange was answered."""
        if decision is _FAILED:
            return _policy(exchange, config, 503)
        if decision is None:
            return True
        if not isinstance(decision, Decision):
            decision = _failed(exchange, config, hook, f"returned {type(decision).__name__}")
            return _policy(exchange, config, 503)
        answer = decision.answer
        if answer is not None:
            if not 400 <= answer.status <= 599:
                _failed(exchange, config, hook, f"answered status {answer.status}")
                return _policy(exchange, config, 503)
            extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers]
            exchange.fail(answer.status, answer.message, f"answered by {config.name}", extra=extra)
            return False
        if decision.group is not None:
            group = exchange.fx.config.upstreams.get(decision.group)
            if group is None:
                text = (
                    f"extension {config.name} chose group {decision.group!r}, which does not exist"
                )
                _failed(exchange, config, hook, text)
                exchange.fail(500, text)
                return False
            exchange.group = group
            if exchange.upload.body.size == 0:  # nothing held yet: the group's replay bound
                exchange.upload.body = RequestBody(group.next_upstream.replay_buffer)
        if decision.set or decision.remove:
            head = exchange.head
            exchange.head = attrs.evolve(head, headers=_rewritten(head.headers, decision))
        if decision.tenant is not None:
            self.tenant = tenant_of(decision.tenant.encode("utf-8"))
        self.view = _view(exchange)
        return True

    # -- the servers, the response ----------------------------------------------------------

    def choose_server(self, exchange: Hooked, failover: Failover) -> bool:
        """A placement (the first, a retry, an admission from the queue): the first extension
        that names one of the servers left (those not tried yet) makes it the next try;
        False: answered."""
        servers = failover.group.servers
        tried = failover.tries
        for index in self.chain.servers:
            config = self.chain.extensions[index]
            candidates = [servers[i].address for i in failover.candidates[tried:]]
            view = self.view
            assert view is not None
            choice = _call(exchange, config, "choose_server", view, candidates)
            if choice is None:
                continue
            if choice is not _FAILED and choice not in candidates:
                choice = _failed(
                    exchange, config, "choose_server", f"chose {choice!r}, no candidate"
                )
            if choice is _FAILED:
                if not _policy(exchange, config, 503):
                    return False
                continue
            at = tried + candidates.index(choice)
            failover.candidates.insert(tried, failover.candidates.pop(at))
            return True
        return True

    def response_head(self, exchange: Hooked) -> bool:
        """The backend's response head about to go out (``exchange.response``): rewritten by
        each extension in turn; False: rejected (answered 502)."""
        for index in self.chain.response:
            config = self.chain.extensions[index]
            response = exchange.response
            assert response is not None
            rewrite = self._response(exchange, config, response.status, response.headers, True)
            if rewrite is _FAILED:
                if not _policy(exchange, config, 502):
                    return False
                continue
            if rewrite is not None:
                headers = _rewritten(response.headers, rewrite)
                exchange.response = attrs.evolve(response, headers=headers)
        return True

    @property
    def own_answers(self) -> AnswerRewrite | None:
        """What rewrites the proxy's own answers (``own_answer``); None: no extension has
        ``on_response_head``."""
        return self.own_answer if self.chain.response else None

    def own_answer(self, status: int, headers: Headers) -> Headers:
        """The fields of one of the proxy's own answers, as each extension rewrites them in
        turn. A failure here is logged and counted, never answered otherwise: the answer
        goes out as it was (an error of ours must not become another one). Its framing
        (``OWN_FRAMING``) is the proxy's: a rewrite of those fields is left out."""
        exchange = self.exchange
        for index in self.chain.response:
            config = self.chain.extensions[index]
            rewrite = self._response(exchange, config, status, headers, False)
            if rewrite is not None and rewrite is not _FAILED:
                keep = [name for name in rewrite.remove if name.lower() not in OWN_FRAMING]
                put = {k: v for k, v in rewrite.set.items() if k.lower() not in OWN_FRAMING}
                headers = _rewritten(headers, HeaderRewrite(set=put, remove=keep))
        return headers

    def _response(
        self,
        exchange: Hooked,
        config: ExtensionConfig,
        status: int,
        headers: Headers,
        from_backend: bool,
    ) -> Any:
        """``on_response_head`` of ``config``'s extension: its rewrite, None, or ``_FAILED``."""
        view = self.view
        if view is None:  # answered before its head was seen by a hook (no route: 404)
            view = self.view = _view(exchange)
        fields = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
        response = Response(status=status, headers=fields, from_backend=from_backend)
        rewrite = _call(exchange, config, "on_response_head", view, response)
        if rewrite is None or rewrite is _FAILED or isinstance(rewrite, HeaderRewrite):
            return rewrite
        return _failed(exchange, config, "on_response_head", "returned no HeaderRewrite")

    def meter(
        self,
        times: TokenTimes,
        started: float,
        is_content: Callable[[bytes], bool] = is_token_event,
        marker: bytes = b"",
    ) -> SseMeter:
        """The meter of an SSE response (as ``SseMeter(times, started, ...)``): one that hands
        each event to the extensions that want them, where any does."""
        if not self.chain.events:
            return SseMeter(times, started, is_content, marker)
        return EventTap(times, started, self.exchange, self, is_content, marker)

    def event(self, exchange: Hooked, event: bytes) -> None:
        view = self.view
        assert view is not None
        for index in self.chain.events:
            config = self.chain.extensions[index]
            _call(exchange, config, "on_sse_event", view, event)

    def finish(self, exchange: Hooked) -> None:
        """The exchange ended: ``on_finish`` of each extension that has it."""
        if not self.chain.finish:
            return  # no record made for nobody (``bench/trivial_hook.py``)
        usage, meter = exchange.usage, exchange.meter
        tokens = usage.output_tokens if usage is not None else None
        if tokens is None and meter is not None:
            tokens = meter.tokens
        view = self.view
        if view is None:  # ended before its head was seen by a hook (no route: 404)
            view = self.view = _view(exchange)
        outcome = Outcome(
            status=exchange.status,
            bytes_sent=exchange.bytes_out,
            bytes_received=exchange.bytes_in,
            tokens=tokens,
            duration=exchange.fx.now - exchange.started,
            reason=exchange.outcome,
            server=exchange.server_address,
        )
        for index in self.chain.finish:
            config = self.chain.extensions[index]
            _call(exchange, config, "on_finish", view, outcome)


class EventTap(SseMeter):
    """An ``SseMeter`` that also splits the stream into events for ``on_sse_event`` (at the
    stream's own terminator, once the meter found it)."""

    __slots__ = ("exchange", "hooks", "pending")

    def __init__(
        self,
        stats: TokenTimes,
        started: float,
        exchange: Hooked,
        hooks: ExchangeHooks,
        is_content: Callable[[bytes], bool] = is_token_event,
        marker: bytes = b"",
    ) -> None:
        super().__init__(stats, started, is_content, marker)
        self.exchange = exchange
        self.hooks = hooks
        self.pending = b""

    def feed(self, data: bytes, now: float) -> None:
        super().feed(data, now)
        pending = self.pending + data
        sep = self.sep
        if not sep:
            self.pending = pending[-65536:]
            return
        *events, self.pending = pending.split(sep)
        for event in events:
            self.hooks.event(self.exchange, event)


# -- helpers ---------------------------------------------------------------------------------


def _view(exchange: Hooked) -> Request:
    head = exchange.head
    route, group = exchange.route, exchange.group
    return Request(
        method=head.method.decode("latin-1"),
        path=head.target.decode("latin-1"),
        headers=tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in head.headers),
        client=exchange.client.peer_ip,
        route=route.prefix if route is not None else "",
        group=group.name if group is not None else "",
        request_id=exchange.request_id.decode("latin-1"),
    )


def _rewritten(headers: Headers, rewrite: HeaderRewrite) -> Headers:
    """``headers`` with ``rewrite``'s fields removed, then set (replacing any of the name)."""
    drop = {name.lower().encode("latin-1") for name in (*rewrite.remove, *rewrite.set)}
    out = [(k, v) for k, v in headers if k.lower() not in drop]
    out += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in rewrite.set.items()]
    return out


def _call(exchange: Hooked, config: ExtensionConfig, hook: str, *args: Any) -> Any:
    """Hook ``hook`` of ``config``'s extension with ``args``; ``_FAILED`` when it raised."""
    try:
        return getattr(config.instance, hook)(*args)
    except Exception as exc:  # foreign code: its failure is its extension's (module header)
        return _failed(exchange, config, hook, f"{type(exc).__name__}: {exc}")


def _failed(exchange: Hooked, config: ExtensionConfig, hook: str, error: str) -> Any:
    """Count and (rate-limited) log a failed hook; returns ``_FAILED``."""
    measurements = exchange.host.measurements
    key = (config.name, hook)
    counts = measurements.extension_errors
    counts[key] = counts.get(key, 0) + 1
    logged = measurements.extension_logged
    now = exchange.fx.now
    last = logged.get(key)
    if last is None or now - last >= LOG_EVERY:
        logged[key] = now
        fields = {
            "extension": config.name,
            "hook": hook,
            "error": error,
            "on_error": config.on_error.value,
            "request_id": exchange.request_id.decode("latin-1"),
            "count": counts[key],
        }
        exchange.fx.emit(Log(event="extension_error", fields=fields))
    return _FAILED


def _policy(exchange: Hooked, config: ExtensionConfig, status: int) -> bool:
    """A failed hook of ``config``: False (answered ``status``) under ``reject``."""
    if config.on_error is HookErrorPolicy.CONTINUE:
        return True
    exchange.release_upstream(close=True)
    exchange.fail(status, "extension failed", f"extension {config.name} failed")
    return False
