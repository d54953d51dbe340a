"""An inference engine's own load, read from its Prometheus ``/metrics`` page.

Obeys the routing rules: pure code, standard library and attrs plus prometheus_client's text
parser, no clock, no randomness, no I/O; a body from a backend never raises anything but
``ReportError``. Why it exists: the proxy's own count of open streams does not see what an
engine queues or how full its KV cache is; vLLM and SGLang publish both as gauges.

What is read (sample names; the parser, not this module, reads names, labels and values):

========================  ===============================  ===========================
field                     vLLM                             SGLang
========================  ===============================  ===========================
``running``               ``vllm:num_requests_running``    ``sglang:num_running_reqs``
``waiting``               ``vllm:num_requests_waiting``    ``sglang:num_queue_reqs``
``kv_cache`` (0..1)       ``vllm:kv_cache_usage_perc``     ``sglang:token_usage``
                          (before vLLM V1:
                          ``vllm:gpu_cache_usage_perc``)
========================  ===============================  ===========================

Beside them: the names the gauges carry as ``model_name`` (the served model), and vLLM's
``vllm:lora_requests_info``, the LoRA adapters it holds (``lora.py`` reads it, on its own
bounds; a line of it that cannot be read leaves the adapters unknown, never the report).

vLLM's ``*_perc`` gauges are fractions despite their name ("1 means 100 percent usage", their
HELP text). Each name is also read with its colon written as ``_``: prometheus_client's
OpenMetrics writer (0.2x, ``escaping=underscores``, its default) escapes sample names with the
label-name alphabet, which has no colon, so an engine asked for OpenMetrics writes
``vllm_num_requests_running`` under ``# TYPE vllm:num_requests_running gauge``.

Rules:

- Samples of one gauge with different label sets (``model_name``, vLLM's ``engine`` index per
  data-parallel engine, SGLang's ``dp_rank``) are summed for ``running`` and ``waiting``;
  ``kv_cache`` takes their maximum (the fullest engine), clamped to [0, 1]. Samples that
  differ only in ``tp_rank`` are one scheduler seen from each tensor-parallel rank (SGLang
  with ``--enable-metrics-for-all-schedulers``; by default only rank 0 reports), so the
  largest of them counts, once.
- A gauge with any negative, NaN or infinite sample is unknown (None): a sum that leaves a
  sample out would be wrong without saying so. Counts are rounded to integers.
- The newer vLLM KV gauge wins over the older one when both are present.
- OpenMetrics bodies (ending in ``# EOF``) need no parser of their own: a gauge's sample line
  is written the same in both formats and comment lines are not read, so
  ``prometheus_client.openmetrics.parser`` (which also rejects a body cut short of its
  ``# EOF``) is not used.

Cost bound: prometheus_client's parser is quadratic in a line's length (measured on one
1 MiB line: 17 s for a comment of spaces, 9 s for a label of escaped quotes, 5 s for 87,000
labels). So only lines that begin with a known gauge's name go to the parser (picked by one
anchored regular expression in C), each at most ``MAX_LINE`` characters, at most
``MAX_SAMPLES`` of them, from a body of at most ``MAX_BODY`` bytes. The caller reads at most
``MAX_BODY`` bytes of the page; a longer body is refused here too, so the bound holds
whatever the caller does. Everything else on the page (histograms, counters, process
metrics) is never parsed, and cannot make a report fail. Measured: 0.3 ms for a vLLM page of
350 lines (the parser alone takes 6 ms on all of it), 0.13 s for the most the parser can be
given (256 lines of 1,024 characters of escaped quotes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs

from muxproxy.routing.lora import LoraReport, read_lora

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = [
    "MAX_BODY",
    "MAX_LINE",
    "MAX_SAMPLES",
    "LoadReport",
    "ReportError",
    "parse_load_report",
]

MAX_BODY = 1 << 20
"""Bytes of a ``/metrics`` body read at most. A vLLM page with 8 data-parallel engines is
about 400 KB (some 15 histograms of 20 to 40 buckets each, per engine)."""

MAX_LINE = 1024
"""Characters of one gauge line at most. Real ones carry two or three short labels
(``model_name``, ``engine``) and are under 200 characters; the bound keeps the parser's
quadratic label scan to milliseconds per line."""

MAX_SAMPLES = 256
"""Gauge lines read at most: 4 gauges x 64 data-parallel ranks x 4 label sets is 1,024."""

_RUNNING = "running"
_WAITING = "waiting"
_KV_CACHE = "kv_cache"
_KV_CACHE_LEGACY = "kv_cache_legacy"

_NAMES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("vllm", _RUNNING),
    "vllm:num_requests_waiting": ("vllm", _WAITING),
    "vllm:kv_cache_usage_perc": ("vllm", _KV_CACHE),
    "vllm:gpu_cache_usage_perc": ("vllm", _KV_CACHE_LEGACY),
    "sglang:num_running_reqs": ("sglang", _RUNNING),
    "sglang:num_queue_reqs": ("sglang", _WAITING),
    "sglang:token_usage": ("sglang", _KV_CACHE),
}
_GAUGES: dict[str, tuple[str, str]] = {
    **_NAMES,
    **{name.replace(":", "_"): where for name, where in _NAMES.items()},
}

# A sample line of a known gauge: the parser strips each line, then reads a name up to "{",
# a space or a tab. Comment lines ("# HELP", "# TYPE", "# EOF") never match.
_GAUGE_LINE = re.compile(
    r"^[ \t]*(" + "|".join(re.escape(name) for name in _GAUGES) + r")[ \t{][^\n]*",
    re.MULTILINE,
)

_REPLICA_LABEL = "tp_rank"
_MODEL_LABEL = "model_name"


class ReportError(ValueError):
    """A body that gives no load report; ``args[0]`` is a short reason fit for a log line."""


@attrs.frozen(kw_only=True)
class LoadReport:
    """One engine's load as it reports it; None where its page does not say (or says
    nonsense)."""

    running: int | None
    """Requests the engine is generating for."""
    waiting: int | None
    """Requests queued in the engine."""
    kv_cache: float | None
    """KV-cache usage, a fraction in [0, 1]."""
    engine: str
    """``"vllm"`` or ``"sglang"``."""
    lora: LoraReport | None = None
    """The LoRA adapters it reports (vLLM's ``lora_requests_info``, ``lora.py``); None: not
    said, or not readable."""
    models: frozenset[str] = frozenset()
    """The names its gauges carry as ``model_name``: the model it serves."""


def parse_load_report(body: bytes) -> LoadReport:
    """The load a ``/metrics`` body (Prometheus text or OpenMetrics) reports.

    Raises ReportError, and nothing else on any body: over ``MAX_BODY`` bytes, not UTF-8, a
    known gauge's line too long or not parseable, more than ``MAX_SAMPLES`` gauge lines, no
    known gauge at all, or gauges of both vLLM and SGLang.
    """
    if len(body) > MAX_BODY:
        raise ReportError(f"body over {MAX_BODY} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ReportError("body is not UTF-8") from None
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    engines: set[str] = set()
    models: set[str] = set()
    parse = parser()
    for count, match in enumerate(_GAUGE_LINE.finditer(text)):
        name = match.group(1)
        if count == MAX_SAMPLES:
            raise ReportError(f"over {MAX_SAMPLES} gauge lines")
        line = match.group(0)
        if len(line) > MAX_LINE:
            raise ReportError(f"{name}: line over {MAX_LINE} characters")
        engine, field = _GAUGES[name]
        engines.add(engine)
        try:
            for family in parse(line):
                for sample in family.samples:
                    samples.setdefault(field, []).append((sample.labels, sample.value))
                    model = sample.labels.get(_MODEL_LABEL)
                    if model:
                        models.add(model)
        except ValueError:  # everything the parser raises on bad text (fuzzed: nothing else)
            raise ReportError(f"{name}: unparseable sample line") from None
    if not engines:
        raise ReportError("no vllm or sglang load gauge")
    if len(engines) > 1:
        raise ReportError("gauges of both vllm and sglang")
    kv_cache = samples.get(_KV_CACHE) or samples.get(_KV_CACHE_LEGACY)
    engine = engines.pop()
    return LoadReport(
        running=_count(samples.get(_RUNNING)),
        waiting=_count(samples.get(_WAITING)),
        kv_cache=None if kv_cache is None else _fraction(kv_cache),
        engine=engine,
        lora=read_lora(text, parse) if engine == "vllm" else None,
        models=frozenset(models),
    )


def parser() -> Callable[[str], Iterable[Metric]]:
    """prometheus_client's text parser, imported on first use (``LoadPoll`` asks for it when
    it is made, so no poll pays for the import). Importing ``prometheus_client`` imports its
    HTTP exposition server too (``http.server``, ``email``, ``urllib.request``...): some 2 MiB
    of memory that a proxy whose groups read no load report would hold for nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    return text_string_to_metric_families


def _valid(value: float) -> bool:
    # The parser gives an int for an integer literal, of any size: never convert those to
    # float (OverflowError past 1e308).
    if isinstance(value, int):
        return value >= 0
    return math.isfinite(value) and value >= 0


def _count(samples: list[tuple[dict[str, str], float]] | None) -> int | None:
    if samples is None or not all(_valid(value) for _, value in samples):
        return None
    largest: dict[tuple[tuple[str, str], ...], int] = {}
    for labels, value in samples:
        key = tuple(sorted(item for item in labels.items() if item[0] != _REPLICA_LABEL))
        number = value if isinstance(value, int) else round(value)
        largest[key] = max(number, largest.get(key, 0))
    return sum(largest.values())


def _fraction(samples: list[tuple[dict[str, str], float]]) -> float | None:
    if not all(_valid(value) for _, value in samples):
        return None
    return max(float(min(value, 1)) for _, value in samples)
