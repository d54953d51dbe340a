"""The extension interface: the hooks an embedder or operator writes, and the records they see.

An extension is a class derived from :class:`Extension`, named in the configuration
(``[[extensions]] module = "pkg.mod:Class"``) and made once per configuration (and per worker)
with its ``settings`` table. Each hook is optional: the base class's does nothing, and the
proxy calls only the hooks a class overrides. The hooks follow one request's life, as
Pingora's ``ProxyHttp`` and Envoy's HTTP filters do:

============================  ==============================================================
``on_request_head``           the request head is routed; may answer, rewrite headers, pick
                              the group, set the tenant (:class:`Decision`)
``on_request_head_async``     the same, for a hook that does I/O; run by the driver under
                              the extension's ``timeout``
``choose_server``             the servers left to try, on each placement (the first try, a
                              retry, an admission from the queue); may name the next one
``on_response_head``          a response head, the backend's or the proxy's own answer (an
                              error, another extension's); may rewrite its headers
``on_sse_event``              each event of an SSE response (observe only)
``on_finish``                 the request ended (:class:`Outcome`)
============================  ==============================================================

Rules every hook obeys (``docs/extending.md``):

- **Synchronous hooks run in the proxy's core**, one event at a time, for every connection
  of the worker: they must not block (no socket, no file, no sleep), or every stream of the
  worker waits with them. I/O belongs in ``on_request_head_async``.
- **Records are copies**: a hook gets frozen views (:class:`Request`), never the proxy's
  state, and changes the request only through what it returns. It keeps no reference to a
  request past ``on_finish``.
- **A failing hook is the extension's failure, not the proxy's**: an exception (or, for the
  async hook, a timeout) is handled by the extension's ``on_error`` policy, logged (rate
  limited) and counted (``muxproxy_extension_errors_total``); the connection and the worker
  go on.

Pure: no import from the rest of muxproxy, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "Answer",
    "Decision",
    "Extension",
    "HeaderRewrite",
    "Outcome",
    "Request",
    "Response",
    "Settings",
]


@attrs.frozen(kw_only=True)
class Request:
    """What a hook sees of a request: a copy, made once per request for its hooks."""

    method: str
    path: str
    """The request target, normalised as it is routed and forwarded."""
    headers: tuple[tuple[str, str], ...]
    """The request's fields in order, names lower case (latin-1 text)."""
    client: str
    """The client's address (the peer's, or the trusted proxy's ``X-Forwarded-For``)."""
    route: str
    """The prefix of the route that matched."""
    group: str
    """The upstream group chosen so far (the route's, or an earlier extension's)."""
    request_id: str
    """``X-Request-ID`` as logged and forwarded."""

    def header(self, name: str) -> str | None:
        """The value of the first field called ``name`` (any case); None when absent."""
        return _first(self.headers, name)


@attrs.frozen(kw_only=True)
class Response:
    """What ``on_response_head`` sees of a response head: a copy."""

    status: int
    headers: tuple[tuple[str, str], ...]
    """The response's fields in order, names lower case (latin-1 text)."""
    from_backend: bool
    """True: the backend's head. False: the proxy's own answer (a *local reply*, as Envoy
    calls it): a 404 for no route, a 429, a 502/503/504, an extension's :class:`Answer`."""

    def header(self, name: str) -> str | None:
        """The value of the first field called ``name`` (any case); None when absent."""
        return _first(self.headers, name)


@attrs.frozen(kw_only=True)
class Answer:
    """A response of the proxy's own instead of the backend's: the shape the route's API
    gives its errors (an OpenAI error object on ``api = "openai"`` routes, a text body
    otherwise), with ``status`` and ``message``."""

    status: int
    """100..599; a status under 400 is answered as given, with ``message`` as its body."""
    message: str
    headers: Sequence[tuple[str, str]] = ()
    """More fields, e.g. ``("www-authenticate", "Bearer")`` on a 401."""


@attrs.frozen(kw_only=True)
class HeaderRewrite:
    """Fields to set (replacing every field of that name) and to remove."""

    set: Mapping[str, str] = attrs.field(factory=dict)
    remove: Sequence[str] = ()


@attrs.frozen(kw_only=True)
class Decision(HeaderRewrite):
    """What ``on_request_head`` decides; every part optional. With ``answer`` the request
    ends there (the first extension that answers wins; the next ones are not called)."""

    answer: Answer | None = None
    group: str | None = None
    """Send the request to this upstream group (it must exist) instead of the route's."""
    tenant: str | None = None
    """The tenant the group's budgets and queue count this request under (instead of the
    group's ``tenant`` source)."""


@attrs.frozen(kw_only=True)
class Outcome:
    """How a request ended, for ``on_finish``."""

    status: int
    """The status the client got (0: none, the client left first)."""
    bytes_sent: int
    """Response body bytes sent to the client."""
    bytes_received: int
    """Request body bytes taken from the client."""
    tokens: int | None
    """Completion tokens, where known (the ``usage`` object of a budgeted group's response,
    else the SSE events relayed); None otherwise."""
    duration: float
    """Seconds from the request head to the end."""
    reason: str
    """``"ok"`` for a whole response, else why it ended (as the access log's ``outcome``)."""
    server: str
    """The backend's address (empty when none was tried)."""


class Settings(Mapping[str, Any]):
    """An extension's ``settings`` table (read only), and the directory of the configuration
    file it came from, so that a file a setting names is found the way TLS certificate paths
    are: relative to the configuration file, not to wherever the proxy was started."""

    __slots__ = ("_table", "config_dir")

    def __init__(
        self, table: Mapping[str, Any] | None = None, *, config_dir: str | PathLike[str] = "."
    ) -> None:
        self._table = dict(table or {})
        self.config_dir = Path(config_dir)
        """The configuration file's directory (``"."``, the working directory, for a
        configuration that came from no file)."""

    def path(self, key: str) -> Path:
        """The setting ``key`` as a file path: a relative one is taken from ``config_dir``.
        Raises ``KeyError`` when the setting is missing, ``TypeError`` when it is no
        string."""
        value = self._table[key]
        if not isinstance(value, str):
            raise TypeError(f"settings.{key}: expected a path, got {type(value).__name__}")
        return self.config_dir / value  # an absolute ``value`` stays as it is

    def __getitem__(self, key: str) -> Any:
        return self._table[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"Settings({self._table!r}, config_dir={str(self.config_dir)!r})"


class Extension:
    """The base of every extension; override the hooks you need (see the module).

    The constructor takes the ``settings`` table of the configuration (a :class:`Settings`
    when the proxy makes it; ``self.settings.path(key)`` finds a file relative to the
    configuration file); raising there (a missing setting, an unreadable file) makes the
    configuration invalid, with the message.
    """

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.settings = settings if isinstance(settings, Settings) else Settings(settings)

    def on_request_head(self, request: Request) -> Decision | None:
        """The request head, once routed; None: no change. Must not block."""
        return None

    async def on_request_head_async(self, request: Request) -> Decision | None:
        """As ``on_request_head``, for I/O (checking a key with a remote service): run by the
        driver, bounded by the extension's ``timeout``; the request waits for it. Called
        after this extension's ``on_request_head``, in configuration order."""
        return None

    def choose_server(self, request: Request, candidates: Sequence[str]) -> str | None:
        """Called on each placement: the first try, a retry to another server (a failure
        before anything reached the client), an admission from the queue. ``candidates``:
        the usable servers not tried yet (``host:port``), in the order the balancer would
        try them; the one to try next, or None to keep the balancer's choice. Must not
        block."""
        return None

    def on_response_head(self, request: Request, response: Response) -> HeaderRewrite | None:
        """A response head before it goes to the client, the backend's or the proxy's own
        (``response.from_backend``); None: no change. A failure on the proxy's own answer
        is logged and counted, and the answer goes out unchanged."""
        return None

    def on_sse_event(self, request: Request, event: bytes) -> None:
        """One event of an SSE response (its bytes, without the blank line that ends it).
        Called per event: keep it cheap."""

    def on_finish(self, request: Request, outcome: Outcome) -> None:
        """The request ended, whatever way. The last hook a request gets."""


def _first(headers: tuple[tuple[str, str], ...], name: str) -> str | None:
    wanted = name.lower()
    for key, value in headers:
        if key == wanted:
            return value
    return None


HOOKS = (
    "on_request_head",
    "on_request_head_async",
    "choose_server",
    "on_response_head",
    "on_sse_event",
    "on_finish",
)
"""The hooks, in the order of a request's life."""


def defines(extension: Extension, hook: str) -> bool:
    """Whether ``extension``'s class overrides ``hook`` (the proxy skips the others)."""
    return getattr(type(extension), hook) is not getattr(Extension, hook)
