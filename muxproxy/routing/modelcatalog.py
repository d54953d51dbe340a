"""The models each group serves: configured (``[upstreams.NAME] models``), or learnt from
its servers' own ``GET /v1/models``, for the proxy's own answer to that request
(``core/apis/modellist.py``).

Theory of operation. A group that lists ``models`` serves exactly those names: nothing is
asked of its servers. A group with ``learn_models`` has each server's ``/v1/models`` read
every ``models_refresh`` (``core/upstream/modelpoll.py``: the sans-IO poll, on the way requests
take); each answer is parsed here (``parse_model_list``) and the server's last good list
kept (``ModelCatalog.learnt``). A server that fails, or answers what is not an OpenAI model
list, keeps its last good list, and the failure is remembered beside it (``failed``) for
``/status``; the group serves the union of its current servers' last good lists. Names are
exact: an engine's ``/v1/models`` names what a request's ``model`` must say (vLLM lists its
LoRA adapters there too).

Bounds. An engine's answer is backend input: nothing in it may crash the proxy or grow it
without bound. The body is read up to ``MAX_BODY`` bytes (the poll's bound); a list of more
than ``MAX_MODELS`` entries, an id that is not a string of 1 to ``MAX_MODEL_NAME``
characters, JSON nested past the parser's recursion limit, a number too long to convert:
each is a ``ModelListError``, never an exception of another kind. ``created`` and
``owned_by`` are kept when they are sane (an integer 0..``MAX_CREATED``, a short string), else given
the defaults a configured model has.

Pure: no clock (``now`` is passed in), no I/O; the catalog is keyed by group name and server
address, and forgets what a new configuration no longer names (``retain``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs

from muxproxy.config import Config, Upstream
from muxproxy.config.groupmodelkeys import MAX_MODEL_NAME, MAX_MODELS

__all__ = [
    "MAX_BODY",
    "ModelCatalog",
    "ModelInfo",
    "ModelListError",
    "parse_model_list",
]

MAX_BODY = 1024 * 1024
"""Bytes of one server's ``/v1/models`` answer read at most: vLLM's, with a base model and a
few LoRA adapters, is under 2 KiB; 1024 entries of the longest names fit."""
MAX_OWNER = 64
"""Characters of an ``owned_by`` kept from an engine (vLLM says ``"vllm"``)."""
MAX_CREATED = 253_402_300_799
"""The largest ``created`` (Unix seconds) kept from an engine: 9999-12-31T23:59:59Z, the last
instant an RFC 3339 ``created_at`` (Anthropic's) can say."""
OWNER = "muxproxy"
"""``owned_by`` of a configured model, or of a learnt one whose engine said nothing sane."""


class ModelListError(ValueError):
    """A server's ``/v1/models`` answer is not an OpenAI model list within the bounds."""


@attrs.frozen(kw_only=True)
class ModelInfo:
    """One model as the proxy lists it."""

    id: str
    """The exact name a request's ``model`` says."""
    created: int = 0
    """Unix seconds (OpenAI's ``created``; Anthropic's ``created_at``); 0: unknown."""
    owned_by: str = OWNER


@attrs.frozen(kw_only=True)
class ServerModels:
    """What one server's polls taught: its last good list, and its last failure."""

    models: tuple[ModelInfo, ...] = ()
    learnt_at: float | None = None
    """When the last good list came; None: no poll of it has succeeded yet."""
    error: str | None = None
    """Why the last poll failed; None: it succeeded (or none ended yet)."""
    error_at: float | None = None


def parse_model_list(body: bytes) -> tuple[ModelInfo, ...]:
    """The models of an OpenAI ``{"object": "list", "data": [{"id": ...}, ...]}`` answer,
    deduplicated in order. Raises ``ModelListError`` for anything else (see the module)."""
    if len(body) > MAX_BODY:
        raise ModelListError(f"larger than {MAX_BODY} bytes")
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ModelListError(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        raise ModelListError('not a model list: no "data" array')
    data: list[Any] = document["data"]
    if len(data) > MAX_MODELS:
        raise ModelListError(f"more than {MAX_MODELS} models")
    models: dict[str, ModelInfo] = {}
    for entry in data:
        if not isinstance(entry, dict):
            raise ModelListError("a model entry is not an object")
        name = entry.get("id")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_MODEL_NAME:
            raise ModelListError(f"a model id is not a string of 1 to {MAX_MODEL_NAME} characters")
        created, owner = entry.get("created"), entry.get("owned_by")
        if isinstance(created, bool) or not isinstance(created, int):
            created = 0
        if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER:
            owner = OWNER
        models.setdefault(
            name, ModelInfo(id=name, created=min(max(created, 0), MAX_CREATED), owned_by=owner)
        )
    return tuple(models.values())


def _unique(groups: Iterable[Iterable[ModelInfo]]) -> tuple[ModelInfo, ...]:
    seen: dict[str, ModelInfo] = {}
    for models in groups:
        for model in models:
            seen.setdefault(model.id, model)
    return tuple(seen.values())


@attrs.define
class ModelCatalog:
    """The learnt lists, by group name and server address; the configured ones are read from
    the configuration each time."""

    servers: dict[tuple[str, str], ServerModels] = attrs.field(factory=dict)

    def learnt(self, group: str, server: str, models: tuple[ModelInfo, ...], now: float) -> bool:
        """A good answer from ``server`` of ``group``; True: its list changed."""
        before = self.servers.get((group, server), ServerModels())
        self.servers[(group, server)] = ServerModels(models=models, learnt_at=now)
        return before.models != models

    def failed(self, group: str, server: str, reason: str, now: float) -> None:
        """A poll of ``server`` failed: its last good list stands, the failure beside it."""
        before = self.servers.get((group, server), ServerModels())
        self.servers[(group, server)] = attrs.evolve(before, error=reason, error_at=now)

    def retain(self, config: Config) -> None:
        """Forget the servers (and groups) that ``config`` no longer names."""
        named = {
            (name, server.address)
            for name, group in config.upstreams.items()
            for server in group.servers
        }
        for key in [key for key in self.servers if key not in named]:
            del self.servers[key]

    def served(self, group: Upstream) -> tuple[ModelInfo, ...]:
        """The models ``group`` serves: its configured ones, else the union of its current
        servers' last good lists."""
        if group.models:
            return tuple(ModelInfo(id=name) for name in group.models)
        learnt = (self.servers.get((group.name, s.address)) for s in group.servers)
        return _unique(found.models for found in learnt if found is not None)

    def known(self, groups: Iterable[Upstream], aliases: Iterable[str]) -> tuple[ModelInfo, ...]:
        """Every model the proxy answers for: the union over ``groups`` in order, then the
        ``aliases`` (names that stand for other models), each name once."""
        aliased = tuple(ModelInfo(id=name) for name in aliases)
        return _unique([*(self.served(group) for group in groups), aliased])

    def status(self, group: Upstream, now: float) -> dict[str, object]:
        """``group``'s models for ``/status``: where they come from, and per server the age of
        its last good list and its last error."""
        served = [model.id for model in self.served(group)]
        if not group.learn_models:
            return {"source": "configured" if group.models else "none", "models": served}
        servers = {}
        for server in group.servers:
            found = self.servers.get((group.name, server.address), ServerModels())
            servers[server.address] = {
                "models": [model.id for model in found.models],
                "age": None if found.learnt_at is None else round(now - found.learnt_at, 3),
                "last_error": found.error,
                "error_age": None if found.error_at is None else round(now - found.error_at, 3),
            }
        return {"source": "learnt", "models": served, "servers": servers}
