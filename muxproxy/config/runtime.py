"""Runtime server state: the operator's weights, drains and downs, beside the configuration,
and the weights of model aliases' targets (a canary's step between model versions).

What an operator changes while the proxy runs (through the admin API) is not configuration:
it is kept here, applied to every worker as the core event ``RuntimeChanged``, and persisted
to a state file so that it survives restarts. A reload of the configuration never clears it;
the core re-applies it to the new configuration's groups, ignoring servers no longer there.

Records are frozen attrs records with validators, like the configuration's: a bad value
raises ``ValueError`` naming the field and what is expected, never later in the core.

The state file is JSON, written atomically (a temporary file in the same directory, fsync,
``os.replace``: POSIX rename(2) replaces the name in one step, so a reader or a crash sees
the old file or the new one, never half of one)::

    {"version": 1, "servers": [{"group": "gpus", "address": "10.0.0.1:8000",
                                "weight": 0, "drain": false, "down": false}],
     "models": [{"alias": "chat-default", "model": "llama-v2", "weight": 10}]}

``models`` is there only when an alias's weight was set; a target without an entry has its
configured weight.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from muxproxy.config.ranges import SERVER_WEIGHT, shown
from muxproxy.config.records import Config
from muxproxy.config.serverid import server_id

__all__ = [
    "STATE_VERSION",
    "RuntimeState",
    "ServerOverride",
    "load_state",
    "resolve_server",
    "save_state",
]

STATE_VERSION = 1
"""The state file's ``version``; another version is refused rather than misread."""

_FIELDS = ("weight", "drain", "down")
_ENTRY_KEYS = frozenset({"group", "address", *_FIELDS})
_MODEL_KEYS = frozenset({"alias", "model", "weight"})


def _check_weight(_instance: object, _attribute: object, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not SERVER_WEIGHT.contains(value):
        raise ValueError(
            f"weight: expected an integer from {SERVER_WEIGHT.text} or null,"
            f" got {shown(value) if type(value) is int else repr(value)}"
        )


def _check_flag(name: str) -> Any:
    def check(_instance: object, _attribute: object, value: Any) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected true or false, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class ServerOverride:
    """What the operator set for one server; the defaults change nothing."""

    weight: int | None = attrs.field(default=None, validator=_check_weight)
    """Replaces the configured weight; 0 drains (as ``drain``); None: the configured one."""
    drain: bool = attrs.field(default=False, validator=_check_flag("drain"))
    """No new sessions or unkeyed requests; known sessions and sticky pins stay."""
    down: bool = attrs.field(default=False, validator=_check_flag("down"))
    """Nothing new at all, as if unhealthy; streams in flight finish."""

    @property
    def is_default(self) -> bool:
        return self.weight is None and not self.drain and not self.down


_DEFAULT = ServerOverride()


def _read_only(
    servers: Mapping[tuple[str, str], ServerOverride],
) -> Mapping[tuple[str, str], ServerOverride]:
    """A read-only copy (the state is a value: a change makes a new one), checked."""
    for key, override in servers.items():
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
            raise ValueError(f"servers: keys are (group, address) pairs of strings, got {key!r}")
        if not isinstance(override, ServerOverride):
            raise ValueError(f"servers[{key!r}]: expected a ServerOverride, got {override!r}")
    return MappingProxyType(dict(servers))


def _model_weights(weights: Mapping[tuple[str, str], int]) -> Mapping[tuple[str, str], int]:
    """A read-only copy of alias target weights, checked."""
    for key, weight in weights.items():
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
            raise ValueError(f"models: keys are (alias, model) pairs of strings, got {key!r}")
        _check_weight(None, None, weight)
        if weight is None:
            raise ValueError(f"models[{key!r}]: expected a weight, got null")
    return MappingProxyType(dict(weights))


@attrs.frozen(kw_only=True)
class RuntimeState:
    """Overrides keyed by (group name, server address as written in the configuration).

    Only servers with a non-default override are kept: resetting a server to defaults
    removes its entry, so an untouched proxy's state is ``empty()``.
    """

    servers: Mapping[tuple[str, str], ServerOverride] = attrs.field(
        factory=dict, converter=_read_only
    )
    models: Mapping[tuple[str, str], int] = attrs.field(factory=dict, converter=_model_weights)
    """Weights set for model alias targets, keyed by (alias, model)."""

    @classmethod
    def empty(cls) -> RuntimeState:
        return cls(servers={})

    @property
    def is_empty(self) -> bool:
        """Nothing set: an untouched proxy's state."""
        return not self.servers and not self.models

    def model_weight(self, alias: str, model: str) -> int | None:
        """The weight set for one target of an alias; None: its configured one."""
        return self.models.get((alias, model))

    def models_changed(self, alias: str, weights: Mapping[str, int | None]) -> RuntimeState:
        """A new state with the weights of ``alias``'s targets (model -> weight; None: back to
        the configured one) set. Raises ``ValueError`` for a bad weight."""
        models = dict(self.models)
        for model, weight in weights.items():
            try:
                _check_weight(None, None, weight)
            except ValueError as exc:
                raise ValueError(f"weights.{model}: {str(exc).removeprefix('weight: ')}") from None
            if weight is None:
                models.pop((alias, model), None)
            else:
                models[(alias, model)] = weight
        return attrs.evolve(self, models=models)

    def get(self, group: str, address: str) -> ServerOverride:
        """The override of one server (the default one if none is set)."""
        return self.servers.get((group, address), _DEFAULT)

    def changed(self, group: str, address: str, **fields: Any) -> RuntimeState:
        """A new state with ``fields`` (``weight``, ``drain``, ``down``) set for one server.

        Raises ``ValueError`` naming the field for an unknown field or a bad value.
        """
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field; expected one of {', '.join(_FIELDS)}")
        override = attrs.evolve(self.get(group, address), **fields)
        servers = dict(self.servers)
        if override.is_default:
            servers.pop((group, address), None)
        else:
            servers[(group, address)] = override
        return RuntimeState(servers=servers, models=self.models)

    def to_json(self) -> dict[str, Any]:
        """The state file's document; entries sorted by group and address (stable diffs)."""
        document: dict[str, Any] = {
            "version": STATE_VERSION,
            "servers": [
                {
                    "group": group,
                    "address": address,
                    "weight": override.weight,
                    "drain": override.drain,
                    "down": override.down,
                }
                for (group, address), override in sorted(self.servers.items())
            ],
        }
        if self.models:
            document["models"] = [
                {"alias": alias, "model": model, "weight": weight}
                for (alias, model), weight in sorted(self.models.items())
            ]
        return document

    @classmethod
    def from_json(cls, data: Any) -> RuntimeState:
        """Parse a state document; raises ``ValueError`` naming the field at fault.

        ``weight``, ``drain`` and ``down`` may be left out (their defaults); ``group`` and
        ``address`` may not; unknown keys and two entries for one server are refused.
        """
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        extra = sorted(set(data) - {"version", "servers", "models"})
        if extra:
            raise ValueError(f"{extra[0]}: unknown key; expected version, servers and models")
        version = data.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"version: expected {STATE_VERSION}, got {version!r}")
        entries = data.get("servers", [])
        if not isinstance(entries, list):
            raise ValueError(f"servers: expected an array, got {type(entries).__name__}")
        servers: dict[tuple[str, str], ServerOverride] = {}
        for index, entry in enumerate(entries):
            path = f"servers[{index}]"
            if not isinstance(entry, dict):
                raise ValueError(f"{path}: expected an object, got {type(entry).__name__}")
            extra = sorted(set(entry) - _ENTRY_KEYS)
            if extra:
                expected = ", ".join(sorted(_ENTRY_KEYS))
                raise ValueError(f"{path}.{extra[0]}: unknown key; expected {expected}")
            names = []
            for key in ("group", "address"):
                value = entry.get(key)
                if not isinstance(value, str) or not value:
                    raise ValueError(f"{path}.{key}: expected a non-empty string, got {value!r}")
                names.append(value)
            group, address = names
            if (group, address) in servers:
                raise ValueError(f"{path}: a second entry for {address} in group {group}")
            try:
                override = ServerOverride(
                    weight=entry.get("weight"),
                    drain=entry.get("drain", False),
                    down=entry.get("down", False),
                )
            except ValueError as exc:
                raise ValueError(f"{path}.{exc}") from None
            if not override.is_default:
                servers[(group, address)] = override
        return cls(servers=servers, models=_models_from_json(data.get("models", [])))


def _models_from_json(entries: Any) -> dict[tuple[str, str], int]:
    """The ``models`` entries of a state document; raises ``ValueError`` naming the field."""
    if not isinstance(entries, list):
        raise ValueError(f"models: expected an array, got {type(entries).__name__}")
    models: dict[tuple[str, str], int] = {}
    for index, entry in enumerate(entries):
        path = f"models[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: expected an object, got {type(entry).__name__}")
        extra = sorted(set(entry) - _MODEL_KEYS)
        if extra:
            raise ValueError(f"{path}.{extra[0]}: unknown key; expected alias, model and weight")
        names = []
        for key in ("alias", "model"):
            value = entry.get(key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{path}.{key}: expected a non-empty string, got {value!r}")
            names.append(value)
        alias, model = names
        weight = entry.get("weight")
        if weight is None:
            raise ValueError(f"{path}.weight: expected an integer from {SERVER_WEIGHT.text}")
        try:
            _check_weight(None, None, weight)
        except ValueError as exc:
            raise ValueError(f"{path}.{exc}") from None
        if (alias, model) in models:
            raise ValueError(f"{path}: a second entry for {model} of alias {alias}")
        models[(alias, model)] = weight
    return models


def load_state(path: str | os.PathLike[str]) -> RuntimeState:
    """The state saved at ``path``; empty if there is no such file.

    Raises ``ValueError`` (with the path) for a file that is not a valid state document,
    ``OSError`` for a file that exists but cannot be read.
    """
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except FileNotFoundError:
        return RuntimeState.empty()
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{os.fspath(path)}: not a JSON state file ({exc})") from None
    try:
        return RuntimeState.from_json(data)
    except ValueError as exc:
        raise ValueError(f"{os.fspath(path)}: {exc}") from None


def save_state(path: str | os.PathLike[str], state: RuntimeState) -> None:
    """Write ``state`` to ``path`` atomically; raises ``OSError`` if it cannot.

    The temporary file lives in the same directory (``os.replace`` is atomic only within one
    file system) and is fsynced before the rename, and the directory after it, so that a
    crash leaves the old state or the new one. On failure the temporary file is removed.
    """
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    data = json.dumps(state.to_json(), indent=2).encode() + b"\n"
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".muxproxy-state-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some systems cannot open a directory; the rename itself is done
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # fsync of a directory is refused on some file systems; the rename is done
    finally:
        os.close(dir_fd)


def resolve_server(config: Config, group: str, server: str) -> str:
    """The address, as configured, of ``server`` in ``group``.

    ``server`` is an address as written in the configuration, or the server's opaque id
    (``config/serverid.py``, as ``/status`` and the sticky cookie show it). Raises
    ``KeyError`` with a message naming the unknown group or server and what is known.
    """
    upstream = config.upstreams.get(group)
    if upstream is None:
        known = ", ".join(sorted(config.upstreams)) or "none"
        raise KeyError(f"unknown upstream group {group!r}; configured groups: {known}")
    secret = upstream.sticky.cookie.secret if upstream.sticky.cookie else ""
    for candidate in upstream.servers:
        if candidate.address == server:
            return candidate.address
    for candidate in upstream.servers:
        if server_id(group, candidate.address, secret).decode("ascii") == server:
            return candidate.address
    known = ", ".join(s.address for s in upstream.servers)
    raise KeyError(
        f"upstream group {group!r} has no server {server!r}; give an address as configured"
        f" ({known}) or a server id as /status shows it"
    )
