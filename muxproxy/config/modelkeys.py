"""The keys of routing by model: a route's ``models`` and the ``[models.NAME]`` aliases.

Internal to :mod:`muxproxy.config`, checked as every table is (:mod:`.checker`): each problem
names its key path and how to fix it. What is refused, and why:

- a route's ``models``: an array of non-empty strings (exact names or shell-style globs);
  an empty array would serve no request, so it is refused rather than read as "every model";
- an alias with no target, a target without a model, a target named twice, or every weight
  0 (the alias could serve no request);
- a target that is itself an alias: resolving one alias is one step, so a request's model is
  rewritten once and the version a conversation gets is one weighted choice.

A target no route serves is not refused here: a route may serve it by a glob, and one that
none serves gets the API's own 404 (``model_not_found``) like any unknown model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from muxproxy.config.checker import Checker, Key, describe, join
from muxproxy.config.routes import ModelAlias, ModelTarget

__all__ = ["ALIAS_KEYS", "TARGET_KEYS", "model_aliases", "model_patterns"]


def model_patterns(check: Checker, value: Any, path: str) -> tuple[str, ...] | None:
    """A route's ``models``: model names or globs."""
    expected = 'an array of model names or globs such as ["llama-3.1-70b", "llama-3.1-70b*"]'
    if not isinstance(value, list) or not value:
        check.add(path, f"expected {expected}, got {describe(value)}")
        return None
    valid = True
    for index, item in enumerate(value):
        if not isinstance(item, str) or not item:
            check.add(f"{path}[{index}]", f"expected a non-empty model name, got {describe(item)}")
            valid = False
    return tuple(value) if valid else None


def _model_name(check: Checker, value: Any, path: str) -> str | None:
    if not isinstance(value, str) or not value:
        check.add(path, f"expected a non-empty model name, got {describe(value)}")
        return None
    return value


TARGET_KEYS = {
    "model": Key(_model_name, required='the model it sends requests to, e.g. "llama-v2"'),
    "weight": Key(Checker.count),
}


def _targets(check: Checker, value: Any, path: str) -> tuple[ModelTarget, ...] | None:
    example = '[{ model = "llama-v1", weight = 9 }, { model = "llama-v2", weight = 1 }]'
    if not isinstance(value, list) or not value:
        check.add(path, f"expected an array of targets such as {example}, got {describe(value)}")
        return None
    targets: list[ModelTarget] = []
    seen: set[str] = set()
    valid = True
    for index, item in enumerate(value):
        where = f"{path}[{index}]"
        values = check.table(item, where, TARGET_KEYS, '{ model = "...", weight = N }')
        if values is None:
            valid = False
            continue
        target = ModelTarget(**values)
        if target.model in seen:
            check.add(
                f"{where}.model", f"{describe(target.model)} is already a target; list it once"
            )
            valid = False
        seen.add(target.model)
        targets.append(target)
    if valid and all(target.weight == 0 for target in targets):
        check.add(path, "every weight is 0, so the alias serves nothing; give one a weight above 0")
        valid = False
    return tuple(targets) if valid else None


ALIAS_KEYS = {
    "targets": Key(_targets, required="an array of { model, weight } tables"),
}


def model_aliases(check: Checker, value: Any) -> dict[str, ModelAlias] | None:
    """The ``[models.NAME]`` tables (None: a problem was reported)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        check.add(
            "models", f'expected a table of aliases such as [models."chat"], got {describe(value)}'
        )
        return None
    aliases: dict[str, ModelAlias] = {}
    valid = True
    for name, item in value.items():
        path = join("models", name)
        if not name:
            check.add(path, "expected a non-empty model alias")
            valid = False
            continue
        values = check.table(item, path, ALIAS_KEYS, "a table with targets = [...]")
        if values is None:
            valid = False
            continue
        aliases[name] = ModelAlias(name=name, targets=values["targets"])
    for name, alias in aliases.items():
        for index, target in enumerate(alias.targets):
            if target.model in aliases:
                check.add(
                    f"{join('models', name)}.targets[{index}].model",
                    f"{describe(target.model)} is an alias itself; name the model it stands for"
                    " (an alias resolves in one step)",
                )
                valid = False
    return aliases if valid else None
