"""Validation of ``[[extensions]]`` (the record is in :mod:`.extensions`).

Each entry's extension is made here, at load, so every way it can fail is a configuration
error naming ``extensions[N].module`` and the fix (:mod:`muxproxy.extensions.loading`): a
module that cannot be imported, a missing class, a class that is not an ``Extension``, a
constructor that refuses its settings. ``muxproxy check`` therefore makes them too, and a
reload makes them afresh.
"""

from __future__ import annotations

import os
from typing import Any

from muxproxy.config.checker import Checker, Key, describe
from muxproxy.config.extensions import ExtensionConfig, HookErrorPolicy
from muxproxy.extensions.loading import LoadError, load_extension, split_name

__all__ = ["EXTENSION_KEYS", "extension_tables"]


def _module(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or split_name(value) is None:
        check.add(path, f'expected "package.module:Class", got {describe(value)}')
        return None
    return value


def _settings(check: Checker, value: Any, path: str) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        check.add(path, f"expected a table, got {describe(value)}")
        return None
    return value


def _on_error(check: Checker, value: Any, path: str) -> HookErrorPolicy | None:
    choice = check.one_of(value, path, [p.value for p in HookErrorPolicy])
    return None if choice is None else HookErrorPolicy(choice)


EXTENSION_KEYS = {
    "module": Key(_module, required='the extension class, as "package.module:Class"'),
    "settings": Key(_settings),
    "timeout": Key(Checker.seconds),
    "on_error": Key(_on_error),
}


def extension_tables(check: Checker, value: Any) -> tuple[ExtensionConfig, ...]:
    """The ``[[extensions]]`` array (``value``; None when the file has none), each entry's
    extension made."""
    if value is None:
        return ()
    items = check.array(value, "extensions", "an array of tables ([[extensions]])")
    # Absolute, so that a worker that makes the extension again finds the same files.
    config_dir = os.path.abspath(check.base_dir or os.curdir)
    out: list[ExtensionConfig] = []
    for index, item in enumerate(items or ()):
        path = f"extensions[{index}]"
        values = check.table(item, path, EXTENSION_KEYS)
        if values is None:
            continue
        try:
            instance = load_extension(values["module"], values.get("settings", {}), config_dir)
        except LoadError as exc:
            check.add(f"{path}.module", str(exc))
            continue
        out.append(ExtensionConfig(**values, config_dir=config_dir, instance=instance))
    return tuple(out)
