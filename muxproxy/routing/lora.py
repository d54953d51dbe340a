"""LoRA adapters: which ones an engine holds, as it reports them, and where a request naming
one goes.

Obeys the routing rules: pure code, standard library and attrs only, no clock, no I/O; a
report from a backend never raises here (what cannot be read is unknown: None).

What vLLM reports (``vllm/v1/metrics/loggers.py``, with LoRA enabled)::

    vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",
                            waiting_lora_adapters="c"} 1.7e9

(one line on the page): a gauge set to the current time, each time the engine logs its
stats, with the label values of that moment: the adapters of the requests it runs, of those
it queues (comma-separated), and how many adapters one batch may hold (``--max-loras``).
prometheus_client keeps every label set a gauge was ever given, so the page carries one
sample per combination seen since the engine started; the newest, the one with the largest
value, is the engine now.

Reading (``read_lora``): every line of the gauge (its name also written with ``_`` for the
colon, as ``loadreport.py`` reads every name) is found by a plain substring search, its
value read from after its last ``}`` (a label value may hold a ``}``, the value and a
timestamp cannot); only the newest line goes to prometheus_client's parser, at most
``MAX_LORA_LINE`` characters, with at most ``MAX_ADAPTERS`` adapters. A newest line that is
too long or unreadable leaves the engine's adapters unknown (None), a ``max_lora`` that is
not a count leaves its slots unknown, and the rest of its report stands as read: LoRA
placement is one feature, degraded alone. The lines are as many as the body holds
(``loadreport.MAX_BODY``): one linear scan, and a float read per line.

Placement (``is_adapter``, ``lora_order``). A request's ``model`` names an adapter when a
server of the group reports it (running or waiting), or when some server reports LoRA
slots, the servers name their base model (the ``model_name`` label of their gauges, vLLM's
served model name) and it is none of those: an adapter no server holds yet. No
configuration says which names are adapters. The servers the group would try (its own
order) are then ranked by tiers, least loaded first within a tier and the group's order on
ties:

1. servers that hold the adapter;
2. servers with a free adapter slot (fewer adapters held than ``max_lora``);
3. the others, whose engines would have to swap an adapter out, or that do not say;
4. any server over its bound (no room under ``max_streams`` or ``max_waiting``, or past
   the bounded-loads bound of ``load.within_bounds``): a hot adapter spills to a second
   server, which then holds it too, rather than melt its first.

A request for the base model (or any name that is not an adapter) keeps the group's order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["MAX_ADAPTERS", "MAX_LORA_LINE", "LoraReport", "is_adapter", "lora_order", "read_lora"]

MAX_LORA_LINE = 4096
"""Characters of the newest ``lora_requests_info`` line at most: room for 32 adapters held
and 32 queued with names of 60 characters. Only that one line is parsed, so the parser's
quadratic label scan costs a few milliseconds at most."""

MAX_ADAPTERS = 256
"""Adapter names read from one line at most (vLLM's ``--max-loras`` is a handful)."""

_MAX_SLOTS_DIGITS = 6
"""A ``max_lora`` of more digits than this is not an engine's (it is unknown then)."""

_SUFFIX = "lora_requests_info{"
_PREFIXES = frozenset({"vllm:", "vllm_"})
_PREFIX_LENGTH = 5
"""The gauge's name is ``vllm:`` (or ``vllm_``, escaped) and ``_SUFFIX`` without its ``{``."""


@attrs.frozen(kw_only=True)
class LoraReport:
    """The adapters one engine reports."""

    loaded: frozenset[str]
    """Adapters of its running and waiting requests: held, or about to be."""
    max_lora: int | None
    """Adapters one batch may hold; None: not said."""

    @property
    def free(self) -> bool:
        """Whether it reports a free adapter slot."""
        return self.max_lora is not None and len(self.loaded) < self.max_lora


def read_lora(text: str, parse: Callable[[str], Iterable[Metric]]) -> LoraReport | None:
    """The adapters a ``/metrics`` page (decoded) reports; None where it says nothing
    readable (see the module header). ``parse``: prometheus_client's text parser."""
    newest: str | None = None
    newest_value = -math.inf
    for line in _lines(text):
        value = _sample_value(line)
        if value is not None and value > newest_value:
            newest, newest_value = line, value
    if newest is None or len(newest) > MAX_LORA_LINE:
        return None
    try:
        families = list(parse(newest))
    except ValueError:  # everything the parser raises on bad text
        return None
    for family in families:
        for sample in family.samples:
            return _report(sample.labels)
    return None


def _lines(text: str) -> Iterator[str]:
    """The gauge's sample lines with labels, found with ``str.find`` (a page without LoRA
    costs one search); each line of ``text`` is looked at once, so the scan is linear."""
    start = 0
    while (at := text.find(_SUFFIX, start)) >= 0:
        begin = text.rfind("\n", 0, at) + 1
        end = text.find("\n", at)
        end = len(text) if end < 0 else end
        start = end
        name_at = at - _PREFIX_LENGTH
        blank = name_at >= begin and not text[begin:name_at].strip(" \t")  # before the name
        if blank and text[name_at:at] in _PREFIXES:
            yield text[begin:end]


def _sample_value(line: str) -> float | None:
    """The value of a sample line with labels, read without the parser; None if none."""
    end = line.rfind("}")
    fields = line[end + 1 :].split()
    if end < 0 or not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _report(labels: dict[str, str]) -> LoraReport | None:
    running = labels.get("running_lora_adapters")
    waiting = labels.get("waiting_lora_adapters")
    if running is None and waiting is None:
        return None
    names = [name.strip() for part in (running, waiting) if part for name in part.split(",")]
    loaded = frozenset(name for name in names if name)
    if len(loaded) > MAX_ADAPTERS:
        return None
    slots = labels.get("max_lora", "").strip()
    max_lora = None
    if slots.isascii() and slots.isdigit() and len(slots) <= _MAX_SLOTS_DIGITS:
        max_lora = int(slots)
    return LoraReport(loaded=loaded, max_lora=max_lora)


def is_adapter(
    model: str, loras: Iterable[LoraReport | None], bases: Iterable[frozenset[str]]
) -> bool:
    """Whether ``model`` names an adapter, by the servers' fresh reports: ``loras`` (their
    adapters) and ``bases`` (their base models' names); see the module header."""
    slots = False
    for lora in loras:
        if lora is None:
            continue
        if model in lora.loaded:
            return True
        slots = slots or lora.max_lora is not None
    if not slots:
        return False
    named = False
    for names in bases:
        if model in names:
            return False
        named = named or bool(names)
    return named


def lora_order(
    model: str,
    order: Sequence[int],
    loras: Sequence[LoraReport | None],
    within: Callable[[int], bool],
    load: Callable[[int], float],
) -> list[int]:
    """``order`` (server indices) ranked for a request naming the adapter ``model``: the
    tiers of the module header, least ``load`` first within one, ``order`` on ties.
    ``loras[i]``: server ``i``'s fresh report of its adapters; ``within(i)``: whether ``i``
    is within its bounds; ``load(i)``: its load per unit of weight."""

    def tier(index: int) -> int:
        if not within(index):
            return 3
        lora = loras[index]
        if lora is None:
            return 2
        if model in lora.loaded:
            return 0
        return 1 if lora.free else 2

    ranked = sorted(enumerate(order), key=lambda item: (tier(item[1]), load(item[1]), item[0]))
    return [index for _, index in ranked]
