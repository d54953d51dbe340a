"""The configuration records of routes and models: ``[[routes]]`` (with a route's ``resume``)
and ``[models.NAME]`` aliases, and the rule that picks a request's route.

Frozen attrs records without validators, like every record of :mod:`.records` (which
re-exports them); validation is :mod:`.sections`' and :mod:`.modelkeys`'.

The route of a request (``RouteTable.choose``): the routes whose ``prefix`` the path starts with,
longest prefix first; among routes of one prefix, those with ``models`` first, in the file's
order. The first whose ``models`` is empty, or matches the body's model, serves it. A request
whose model is not known (its path speaks no LLM API, its body is no JSON object with a
``model`` within ``limits.max_route_body``) skips the routes with ``models``: it is routed by
path alone, as when no route has ``models``.

``RouteTable`` makes that choice from a per-configuration index, the routes by prefix and the
prefixes' lengths longest first: a request costs one dictionary lookup per distinct prefix
length, however many routes there are (a property test holds it to the rule above, written
as a walk over every route, in ``tests/test_config_route_table.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from fnmatch import fnmatchcase

import attrs

__all__ = [
    "RESUME_CREDENTIALS",
    "RESUME_WINDOW",
    "Api",
    "ModelAlias",
    "ModelTarget",
    "Resume",
    "Route",
    "RouteTable",
    "model_matches",
]


class Api(enum.Enum):
    """The API a route serves, which shapes the proxy's own error responses."""

    OPENAI = "openai"
    """OpenAI-style: errors as ``{"error": {"message", "type", "param", "code"}}`` JSON, which
    the OpenAI SDKs turn into the message of the exception they raise."""


RESUME_WINDOW = 256 * 1024
"""Bytes of events a resumable stream keeps (``resume.window``)."""
RESUME_CREDENTIALS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie")
"""The fields that carry a client's credentials (``resume.credential_headers``)."""


@attrs.frozen(kw_only=True)
class Resume:
    """A route's ``resume`` table: SSE streams that survive a reconnect (``docs/resume.md``)."""

    window: int = RESUME_WINDOW
    """The last bytes of events kept per stream; a resume from before them is refused."""
    linger: float = 30.0
    """Seconds a stream's backend keeps running after its client went away, for the client
    to come back; also how long the events of an ended stream are kept."""
    store: str | None = None
    """A Redis URL (``redis://`` or ``rediss://``) where the stream's events are also kept,
    so a reconnect that reaches another worker or replica is served; None: this process only."""
    credential_headers: tuple[str, ...] = RESUME_CREDENTIALS
    """The request fields (lower case) a resume must carry as the request that began the
    stream did: the stream is bound to a SHA-256 of them (``core/streams/resumebind.py``)."""
    lease: float = 5.0
    """With ``store``: seconds the owner's lease on a live stream lasts in Redis (renewed
    every third of it); a reader that finds it expired (the owner died) ends at once."""


@attrs.frozen(kw_only=True)
class Route:
    prefix: str
    """The path prefix this route serves; the longest matching prefix wins (then the routes
    with ``models`` of that prefix, in order, before the one without)."""
    upstream: str
    """The name of the ``[upstreams.NAME]`` group its requests go to."""
    retry_until_first_event: bool = False
    """Hold a text/event-stream response head until its first content event (comments, role
    chunks, framing are held with it, up to the stream's buffer), so a backend that fails, or
    sends an error event (``overloaded_error``: ``docs/apis.md``), before its first token can
    be retried (as ``"error"``): the client gets nothing of the failed attempt."""
    sse_heartbeat: float | None = None
    """Seconds without upstream bytes after which a text/event-stream response gets an SSE
    comment (``: keep-alive``), written between events only; None: never."""
    continue_on_failure: bool = False
    """When a chat completion's or an Anthropic message's backend fails mid-stream, have the
    next server finish the answer from the text relayed so far (``docs/apis.md``: an
    assistant message, or prefill), within ``next_upstream.tries``."""
    resume: Resume | None = None
    """Number the events of text/event-stream responses and keep them, so that a client
    that reconnects with ``Last-Event-ID`` gets the rest (``core/streams/resume.py``); None: off."""
    api: Api | None = None
    """With ``"openai"`` (``Api.OPENAI``) the proxy's own errors on this route (502, 503,
    504, 413, 431...) carry the OpenAI error object instead of plain text
    (``muxproxy.core.http.errors``)."""
    models: tuple[str, ...] = ()
    """Serve only requests whose JSON body names one of these models: exact names or
    shell-style globs (``"llama-3.1-70b*"``), read on the LLM APIs' paths (chat completions,
    completions, responses, messages, embeddings) from the body's first
    ``limits.max_route_body`` bytes. Empty: every request of the prefix, whatever its model."""


@attrs.frozen(kw_only=True)
class ModelTarget:
    """One model an alias may send a request to, and its share."""

    model: str
    """The model name written into the request's body (a route's ``models`` serves it)."""
    weight: int = 1
    """The target's share of new conversations (0: none); the admin API may change it."""


@attrs.frozen(kw_only=True)
class ModelAlias:
    """A ``[models.NAME]`` table: a model name clients send that the proxy resolves to one of
    its ``targets`` (a canary between model versions, ``docs/models.md``)."""

    name: str
    """The alias, as clients name it in the body's ``model``."""
    targets: tuple[ModelTarget, ...]
    """The models it stands for, with their weights; a conversation (its session key) keeps
    its target while the weights do not move it."""


def model_matches(model: str, patterns: Iterable[str]) -> bool:
    """Whether ``model`` is one of ``patterns``: exact names or shell-style globs
    (``fnmatchcase``, case-sensitive everywhere: ``"llama-3.1-70b*"``)."""
    return any(model == pattern or fnmatchcase(model, pattern) for pattern in patterns)


class RouteTable:
    """The routes of one configuration, indexed for the rule of the module header: made once per
    configuration, read by every request."""

    __slots__ = ("_by_prefix", "_lengths")

    def __init__(self, routes: Iterable[Route]) -> None:
        by_prefix: dict[str, list[Route]] = {}
        for route in routes:
            by_prefix.setdefault(route.prefix, []).append(route)
        # Among routes of one prefix: those with ``models`` first, each kind in the file's order
        # (``sorted`` is stable): the order of the walk is the rule's rank.
        self._by_prefix = {
            prefix: tuple(sorted(same, key=lambda route: not route.models))
            for prefix, same in by_prefix.items()
        }
        self._lengths = tuple(sorted({len(prefix) for prefix in by_prefix}, reverse=True))

    def choose(self, path: str, model: str | None) -> Route | None:
        """The route of a request for ``path`` whose body names ``model`` (None: not known), as
        the module header says; None: no route serves it."""
        by_prefix = self._by_prefix
        size = len(path)
        for length in self._lengths:
            if length > size:
                continue
            same = by_prefix.get(path[:length])
            if same is None:
                continue
            for route in same:
                if not route.models:
                    return route
                if model is not None and model_matches(model, route.models):
                    return route
        return None

    def model_decides(self, path: str) -> bool:
        """Whether a request's model can change which route serves ``path``: the longest
        prefix ``path`` starts with has a route with ``models`` (a route without any, of a
        longer prefix, would win whatever the model)."""
        by_prefix = self._by_prefix
        size = len(path)
        for length in self._lengths:
            if length <= size:
                same = by_prefix.get(path[:length])
                if same is not None:
                    return bool(same[0].models)
        return False
