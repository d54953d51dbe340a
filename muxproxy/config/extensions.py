"""The record of one ``[[extensions]]`` entry: an extension hook class, its settings, and what
its failures do (``docs/extending.md``).

A leaf of :mod:`muxproxy.config` (no import from the rest of it), so :mod:`.records` can name
it in :class:`~muxproxy.config.records.Config`; the checks are in :mod:`.extensionkeys`.

The record holds the extension made from it (``instance``): made once when the configuration
is loaded, so that a module that does not import or a constructor that refuses its settings
is a configuration error, not a failing request. A record that is pickled (the configuration
a worker gets) is made again where it is unpickled: an extension's own state (a file read, a
client) belongs to its process and is never copied.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from muxproxy.extensions.api import Extension
from muxproxy.extensions.loading import load_extension

__all__ = ["ExtensionConfig", "HookErrorPolicy"]


class HookErrorPolicy(enum.Enum):
    """What a failing hook of the extension does to its request (``on_error``)."""

    REJECT = "reject"
    """The request is answered 503 (the extension could not decide: fail closed)."""
    CONTINUE = "continue"
    """The request goes on as if the hook had returned nothing (fail open)."""


@attrs.frozen(kw_only=True)
class ExtensionConfig:
    """``[[extensions]]``: one extension, in the order its hooks run."""

    module: str
    """The class, as ``"package.module:Class"``, derived from
    ``muxproxy.extensions.Extension``; its module must be importable (installed, or on
    ``PYTHONPATH``)."""
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    """Any table: handed to the class's constructor. An extension that reads a file a
    setting names with ``settings.path(key)`` takes a relative path from the configuration
    file's directory, as TLS file paths are."""
    config_dir: str = "."
    """The configuration file's directory, absolute: where a relative path in ``settings``
    starts (``Settings.path``), as for TLS files."""
    timeout: float = 1.0
    """Seconds its ``on_request_head_async`` hook may take before it counts as failed."""
    on_error: HookErrorPolicy = HookErrorPolicy.REJECT
    """A hook that raises or times out: ``reject`` answers 503, ``continue`` goes on as if it
    returned nothing. Either way it is logged and counted."""
    instance: Extension = attrs.field(
        eq=False,
        repr=False,
        default=attrs.Factory(
            lambda self: load_extension(self.module, self.settings, self.config_dir), True
        ),
    )
    """The extension made from ``module`` and ``settings`` (made here when not given;
    raises ``LoadError``)."""

    @property
    def name(self) -> str:
        """The class's name, as logs and metrics label the extension."""
        return self.module.rpartition(":")[2]

    def __reduce__(self) -> tuple[Any, ...]:
        fields = (self.module, dict(self.settings), self.config_dir, self.timeout, self.on_error)
        return (_remade, fields)


def _remade(
    module: str,
    settings: Mapping[str, Any],
    config_dir: str,
    timeout: float,
    on_error: HookErrorPolicy,
) -> ExtensionConfig:
    """The record unpickled in another process: its extension made again there."""
    instance = load_extension(module, settings, config_dir)
    return ExtensionConfig(
        module=module,
        settings=settings,
        config_dir=config_dir,
        timeout=timeout,
        on_error=on_error,
        instance=instance,
    )
