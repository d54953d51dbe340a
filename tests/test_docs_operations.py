"""The operator's documents against the code: ``docs/from-nginx.md`` and ``docs/operations.md``.

What is checked, so that the documents cannot drift from the code:

- Every ```` ```toml ```` block is a configuration that ``parse_config`` accepts. A block whose
  first line is ``# fragment`` shows a few sections only: it is merged into ``BASE`` (one
  listener, one group ``gpus``; the fragment's tables merged into those, its values winning)
  and the result must be accepted. File paths are relative to a fresh directory.
- Every ``muxproxy_*`` name in the documents is a metric of ``series.METRICS`` or
  ``series.DISCOVERY_METRICS`` (or a histogram's ``_bucket`` / ``_sum`` / ``_count`` series
  of one), but the sticky cookie's default name. In the alert rules (the ```` ```yaml ````
  block) and the Grafana panels, each label a selector or a ``by (...)`` names belongs to
  the metrics it applies to.
- The table "Every metric" lists exactly those, with their types and labels.
- The limits table lists every field of ``Limits``, and each ``limits.*`` and ``timeouts.*``
  row's default is the record's.
- Every ``timeouts.X``, ``limits.X``, ``log.X``, ``admin.X`` (and a few group keys) named in
  backticks is a field of its record.
- The levels of the error log events table are those of ``muxproxy.trio.logs.LEVELS``.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

from muxproxy.config import (
    AdminSettings,
    HealthCheck,
    Limits,
    LogSettings,
    NextUpstream,
    Resume,
    Sticky,
    StickyCookie,
    Timeouts,
    parse_config,
)
from muxproxy.core.observe.series import DISCOVERY_METRICS, HISTOGRAM, PREFIX
from muxproxy.core.observe.series import METRICS as CORE_METRICS
from muxproxy.trio.logs import LEVELS

METRICS = {**CORE_METRICS, **DISCOVERY_METRICS}
"""The core's metrics and discovery's (measured by the driver)."""

DOCS = Path(__file__).resolve().parent.parent / "docs"
FROM_NGINX = DOCS / "from-nginx.md"
OPERATIONS = DOCS / "operations.md"
PAGES = (FROM_NGINX, OPERATIONS)

FRAGMENT = "# fragment"
BASE: dict[str, Any] = {
    "listeners": [{"address": "127.0.0.1:8080"}],
    "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
}
"""What a ``# fragment`` block is merged into."""

_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)
_METRIC = re.compile(r"\bmuxproxy_[a-z0-9_]*[a-z0-9]")
_SELECTOR = re.compile(r"\b(muxproxy_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)\s*\(")
_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")
_LABEL_NAMES = re.compile(r"`([a-z_]+)`")


def _blocks(page: Path, language: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every fenced block of ``language`` in ``page``."""
    text = page.read_text(encoding="utf-8")
    for match in _FENCE.finditer(text):
        if match[2] == language:
            indent = len(match[1])
            body = "".join(line[indent:] for line in match[3].splitlines(keepends=True))
            yield text.count("\n", 0, match.start()) + 1, body


def _merged(base: Mapping[str, Any], fragment: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``fragment`` merged in: tables merged key by key, other values replaced."""
    out = copy.deepcopy(dict(base))
    for key, value in fragment.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


TOML_BLOCKS = [
    pytest.param(text, id=f"{page.name}:{line}")
    for page in PAGES
    for line, text in _blocks(page, "toml")
]


def test_each_page_has_toml_examples() -> None:
    for page in PAGES:
        assert list(_blocks(page, "toml")), f"{page.name}: no toml block found"


@pytest.mark.parametrize("text", TOML_BLOCKS)
def test_toml_example_is_a_valid_configuration(text: str, tmp_path: Path) -> None:
    data: dict[str, Any] = tomllib.loads(text)
    if text.startswith(FRAGMENT):
        data = _merged(BASE, data)
    parse_config(data, base_dir=str(tmp_path), environ={})


# -- metrics ---------------------------------------------------------------------------------


def _metric(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the metric of ``series.METRICS``, the labels of this series) for a series name."""
    short = name.removeprefix(PREFIX)
    if short in METRICS:
        return short, METRICS[short][1]
    for suffix in _SERIES_SUFFIXES:
        base = short.removesuffix(suffix)
        if base != short and base in METRICS and METRICS[base][0] == HISTOGRAM:
            extra = ("le",) if suffix == "_bucket" else ()
            return base, METRICS[base][1] + extra
    return None


def test_every_metric_name_in_the_documents_exists() -> None:
    allowed = {StickyCookie().name}  # the cookie's default name, not a metric
    for page in PAGES:
        for name in set(_METRIC.findall(page.read_text(encoding="utf-8"))) - allowed:
            assert _metric(name) is not None, f"{page.name}: {name} is not a muxproxy metric"


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one opened just before ``start``."""
    depth = 1
    for at in range(start, len(text)):
        if text[at] == "(":
            depth += 1
        elif text[at] == ")":
            depth -= 1
            if depth == 0:
                return at
    raise AssertionError(f"unbalanced parentheses in {text!r}")


def _check_promql(expr: str) -> None:
    """Every metric exists; the labels of its selector and of each ``by (...)`` over it exist."""
    names = _METRIC.findall(expr)
    assert names, f"no muxproxy metric in {expr!r}"
    for name in names:
        assert _metric(name) is not None, f"{name} is not a muxproxy metric: {expr!r}"
    for match in _SELECTOR.finditer(expr):
        found = _metric(match[1])
        assert found is not None
        for label in _MATCHER.findall(match[2]):
            assert label in found[1], f"{match[1]} has no label {label!r}: {expr!r}"
    for match in _BY.finditer(expr):
        labels = [label.strip() for label in match[1].split(",") if label.strip()]
        inner = expr[match.end() : _closing(expr, match.end())]
        for name in _METRIC.findall(inner):
            found = _metric(name)
            assert found is not None
            for label in labels:
                assert label in found[1], f"by ({label}) over {name}, which lacks it: {expr!r}"


def _alert_exprs() -> list[str]:
    blocks = list(_blocks(OPERATIONS, "yaml"))
    assert len(blocks) == 1, "operations.md: expected one yaml block, the alert rules"
    return re.findall(r"^\s*expr:\s*(.+?)\s*$", blocks[0][1], re.MULTILINE)


def test_alert_rules_use_real_metrics_and_labels() -> None:
    exprs = _alert_exprs()
    assert len(exprs) >= 10
    for expr in exprs:
        _check_promql(expr)


def test_alert_rules_are_prometheus_rule_groups() -> None:
    import yaml

    (_, text), *_ = _blocks(OPERATIONS, "yaml")
    document = yaml.safe_load(text)
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    assert all(isinstance(rule["alert"], str) for rule in rules)
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "two alerts of one name"
    # Each expr is one line, so the test above saw every one of them whole.
    assert [str(rule["expr"]) for rule in rules] == _alert_exprs()


def _section(page: Path, heading: str) -> str:
    """The text of ``page`` from ``heading`` (a whole line) to the next heading."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    end = re.compile(r"^#{1,6} ", re.MULTILINE).search(text, start)
    return text[start : end.start() if end else len(text)]


def _rows(section: str) -> list[list[str]]:
    """The body rows of the first table in ``section``, as stripped cells."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]


def test_grafana_panels_use_real_metrics_and_labels() -> None:
    rows = _rows(_section(OPERATIONS, "### Grafana panels"))
    assert len(rows) >= 15
    for row in rows:
        queries = re.findall(r"`([^`]*muxproxy_[^`]*)`", row[1])
        assert queries, f"no query in the panel {row[0]!r}"
        for query in queries:
            _check_promql(query)


def test_the_metric_table_lists_every_metric_with_its_type_and_labels() -> None:
    documented: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, kind, labels, _ in _rows(_section(OPERATIONS, "### Every metric")):
        documented[name.strip("`").removeprefix(PREFIX)] = (
            kind,
            tuple(_LABEL_NAMES.findall(labels)),
        )
    assert documented == {name: (kind, labels) for name, (kind, labels, _) in METRICS.items()}


# -- limits, keys, log levels ------------------------------------------------------------------

_RECORDS: dict[str, type[Any]] = {"limits": Limits, "timeouts": Timeouts}


def _default(record: type[Any], name: str) -> Any:
    fields = {field.name: field for field in attrs.fields(record)}
    assert name in fields, f"{record.__name__} has no field {name!r}"
    return fields[name].default


def test_the_limits_table_covers_every_limit_with_its_default() -> None:
    seen: set[str] = set()
    for row in _rows(_section(OPERATIONS, "## Limits and the attacks they answer")):
        key = row[0].strip("`")
        section, _, name = key.partition(".")
        record = _RECORDS.get(section)
        if record is None:
            continue
        number = re.match(r"([0-9][0-9,]*(?:\.[0-9]+)?)", row[1])
        assert number is not None, f"{key}: no default in {row[1]!r}"
        assert float(number[1].replace(",", "")) == _default(record, name), key
        if record is Limits:
            seen.add(name)
    assert seen == {field.name for field in attrs.fields(Limits)}


_KEY_RECORDS: dict[str, type[Any]] = {
    "timeouts": Timeouts,
    "limits": Limits,
    "log": LogSettings,
    "admin": AdminSettings,
    "next_upstream": NextUpstream,
    "sticky": Sticky,
    "health_check": HealthCheck,
    "resume": Resume,
}
_KEY = re.compile(r"`(" + "|".join(_KEY_RECORDS) + r")\.([a-z0-9_]+)")


def test_every_key_named_exists() -> None:
    for page in PAGES:
        for section, name in _KEY.findall(page.read_text(encoding="utf-8")):
            if section == "sticky" and name == "cookie":
                continue  # a table of its own, ``sticky.cookie``
            _default(_KEY_RECORDS[section], name)


def test_error_log_levels_are_the_code_s() -> None:
    rows = _rows(_section(OPERATIONS, "### Error log events"))
    assert rows
    for events, level, _ in rows:
        for event in re.findall(r"`([a-z_]+)`", events):
            expected = LEVELS.get(event, 20)  # not listed: INFO
            assert level == {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR"}[expected], event
