"""Making an extension from its configuration: ``"pkg.mod:Class"`` and its settings.

Each failure is a :class:`LoadError` whose message says what was wrong and how to fix it:
the module cannot be imported (not on ``sys.path``, or it raised), the class is missing or is
not an :class:`~muxproxy.extensions.api.Extension`, or its constructor raised on the settings.
The configuration's loader (``config/extensionkeys.py``) adds the key path in front.

Importing a module runs its code: this is the one place an extension's import happens, at
configuration load (the supervisor's check, and each worker's), never on a request's path.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from os import PathLike
from typing import Any

from muxproxy.extensions.api import Extension, Settings

__all__ = ["LoadError", "load_extension", "split_name"]


class LoadError(Exception):
    """An extension that cannot be made; the message says why and what to do."""


def split_name(name: str) -> tuple[str, str] | None:
    """``("pkg.mod", "Class")`` of ``"pkg.mod:Class"``; None when it is not of that form."""
    module, colon, attribute = name.partition(":")
    parts = [*module.split("."), *attribute.split(".")]
    if not colon or not all(part.isidentifier() for part in parts):
        return None
    return module, attribute


def load_extension(
    name: str, settings: Mapping[str, Any], config_dir: str | PathLike[str] = "."
) -> Extension:
    """The extension ``name`` (``"pkg.mod:Class"``) made with ``settings``, given as
    :class:`~muxproxy.extensions.api.Settings` of ``config_dir`` (the configuration file's
    directory). Raises :class:`LoadError`."""
    parts = split_name(name)
    if parts is None:
        raise LoadError(f'expected "package.module:Class", got {name!r}')
    module_name, attribute = parts
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise LoadError(
            f"cannot import {module_name!r} ({exc}); install it, or add its directory to PYTHONPATH"
        ) from None
    except Exception as exc:  # the module's own code raised: its author's to fix
        raise LoadError(f"importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    target: object = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise LoadError(f"{module_name!r} has no {attribute!r}; check the class name")
    if not isinstance(target, type) or not issubclass(target, Extension):
        raise LoadError(
            f"{name} is not a class derived from muxproxy.extensions.Extension; derive it"
            " from that class"
        )
    try:
        return target(Settings(settings, config_dir=config_dir))
    except Exception as exc:  # the constructor judged its settings: its message is the fix
        raise LoadError(f"{name} refused its settings: {type(exc).__name__}: {exc}") from None
