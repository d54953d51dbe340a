"""Model aliases at run time: each alias's targets with the weights in force, and the choice
of one target for a request.

Obeys the routing rules: pure code, no clock, no I/O; the random draw for a request without
a session key comes from a splitmix64 sequence (``load.Sampler``) seeded here, not from the
process's random state. Why: a replay of the same inputs gives the same choices, in tests
and in every replica.

The weights in force are the configured ones (``[models.NAME] targets``) with the operator's
runtime weights over them (``RuntimeState.models``, set through the admin API and shared
through the fleet store like server weights). A change applies to the next choice; a request
already placed keeps the model it was given, so no stream in flight is moved or cut.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from muxproxy.config.records import ModelAlias
from muxproxy.config.runtime import RuntimeState
from muxproxy.routing.load import Sampler
from muxproxy.routing.models import pick_target

__all__ = ["Aliases"]

_SEED = 0x6D6F64656C73  # any constant: the draws only need to be spread, not secret


class _Draws:
    """``models.Random`` over a ``Sampler``: a float in [0, 1)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def random(self) -> float:
        return (self.sampler.next() >> 11) / float(1 << 53)


class Aliases:
    """The aliases' weights in force, and their choices."""

    def __init__(self) -> None:
        self.runtime = RuntimeState.empty()
        """The operator's runtime state (its ``models`` weights are read here)."""
        self._draws = _Draws(Sampler(_SEED))

    def targets(self, alias: ModelAlias) -> list[tuple[str, int]]:
        """``(model, weight)`` of each target, with the runtime weight where one is set."""
        runtime = self.runtime
        out = []
        for target in alias.targets:
            weight = runtime.model_weight(alias.name, target.model)
            out.append((target.model, target.weight if weight is None else weight))
        return out

    def pick(self, alias: ModelAlias, session_key: bytes | None) -> str | None:
        """The target model for a request naming ``alias``: by rendezvous on the session key
        (a conversation keeps its target while the weights do not move it), else a weighted
        draw; None when every weight in force is 0."""
        return pick_target(self.targets(alias), session_key, self._draws, alias=alias.name)

    def status(self, aliases: Mapping[str, ModelAlias]) -> dict[str, Any]:
        """Each alias's targets with their configured and runtime weights (JSON-able)."""
        out: dict[str, Any] = {}
        for name, alias in aliases.items():
            targets = []
            for target in alias.targets:
                runtime = self.runtime.model_weight(name, target.model)
                targets.append(
                    {
                        "model": target.model,
                        "configured_weight": target.weight,
                        "runtime_weight": runtime,
                        "weight": target.weight if runtime is None else runtime,
                    }
                )
            out[name] = {"targets": targets}
        return out
