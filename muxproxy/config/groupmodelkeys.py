"""Validation of a group's models: ``models`` (the names it serves, listed) and
``learn_models``/``models_refresh`` (read from its servers' own ``GET /v1/models``).

Internal to :mod:`muxproxy.config`; :mod:`.upstreams` calls it. Each function checks one value
at one key path, reports through the :class:`Checker` and returns the value, or None (False)
when something was wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from muxproxy.config.checker import Checker, describe
from muxproxy.config.records import Upstream

__all__ = ["MAX_MODELS", "MAX_MODEL_NAME", "model_names", "models_valid"]

MAX_MODELS = 1024
"""Names a group's ``models`` may list: far more than one group of servers serves, and
bounded, as every answer of the proxy's ``GET /v1/models`` carries them all."""
MAX_MODEL_NAME = 256
"""Characters of one model name: a Hugging Face id (``org/name-variant``) is well under."""


def model_names(check: Checker, value: Any, path: str) -> tuple[str, ...] | None:
    items = check.array(value, path, 'an array of model names, e.g. ["llama-3.1-70b"]')
    if items is None:
        return None
    if len(items) > MAX_MODELS:
        check.add(path, f"expected at most {MAX_MODELS} model names, got {len(items)}")
        return None
    names: list[str] = []
    for number, item in enumerate(items):
        if not isinstance(item, str) or not item or len(item) > MAX_MODEL_NAME:
            check.add(
                f"{path}[{number}]",
                f"expected a model name of 1 to {MAX_MODEL_NAME} characters, got {describe(item)}",
            )
            return None
        if item in names:
            check.add(f"{path}[{number}]", f"{item!r} is listed twice; list each model once")
            return None
        names.append(item)
    return tuple(names)


def models_valid(check: Checker, path: str, group: Upstream, table: Mapping[str, Any]) -> bool:
    """``models`` lists the group's models, ``learn_models`` asks its servers: one or the
    other, and ``models_refresh`` only with the second."""
    if group.models and group.learn_models:
        check.add(
            f"{path}.learn_models",
            "and models are both set; list the models, or learn them from the servers (remove one)",
        )
        return False
    if "models_refresh" in table and not group.learn_models:
        check.add(
            f"{path}.models_refresh",
            "is how often learnt models are read again, but the group does not learn them;"
            " add learn_models = true or remove it",
        )
        return False
    return True
