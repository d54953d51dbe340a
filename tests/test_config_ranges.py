"""The range of every numeric configuration key (``muxproxy/config/ranges.py``).

What is held here, so that a bound cannot be forgotten or drift:

- every numeric field of every configuration record is a key with a range, and every range
  is a key's;
- for every key: the top of its range loads, one past it (the next float, for seconds) is
  refused with the key, the value, the range and the fix; the bottom loads (or, for a range
  open at the bottom such as seconds, is refused); NaN, the infinities and ``true`` are
  refused;
- a property over any key and any number: what loads is in range, what is not in range is
  refused naming its key;
- ``docs/operations.md`` lists the ranges as the code has them.
"""

from __future__ import annotations

import math
import tomllib
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muxproxy.config import ConfigError, parse_config, records
from muxproxy.config.keydocs import entries, iter_examples
from muxproxy.config.layout import tables
from muxproxy.config.ranges import RANGES, Range, pattern, render_markdown, with_table

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"

CROSS_CHECKED = {
    "upstreams.NAME.health_check.timeout": "to be less than interval",
    "upstreams.NAME.load_report.timeout": "to be less than interval",
}
"""Keys whose top cannot load for another rule: a check must end before the next begins,
and the interval is at most a day too."""
PAIRED = {
    *CROSS_CHECKED,
    "upstreams.NAME.health_check.interval",
    "upstreams.NAME.load_report.interval",
}
"""Keys another key's value may refuse (an interval below its timeout)."""

OWN_BOUNDS = {
    "upstreams.NAME.health_check.expect_status": "100..599",
    "upstreams.NAME.prefix.load_factor": "from 1 to 100",
    "upstreams.NAME.load_report.kv_cache_limit": "(0, 1]",
}
"""Keys whose checking function states the range itself, with its own advice."""


def numeric_fields() -> list[tuple[type[Any], str, Any]]:
    """(record, field, type) of every numeric field a configuration sets, in every record."""
    found = []
    for value in vars(records).values():
        if not (isinstance(value, type) and attrs.has(value)):
            continue
        hints = typing.get_type_hints(value)
        for field in attrs.fields(value):
            hint = hints[field.name]
            kinds = set(typing.get_args(hint)) or {hint}
            if field.init and kinds & {int, float}:
                found.append((value, field.name, hint))
    return found


def test_every_numeric_field_of_the_config_records_has_a_range() -> None:
    fields = numeric_fields()
    assert len(fields) >= 50, "found few numeric fields: the test looks in the wrong place"
    for record, name, _ in fields:
        paths = [f"{t.path}.{name}" for t in tables() if t.record is record and name in t.keys]
        assert paths, f"{record.__name__}.{name} is a number no configuration table sets"
        for path in paths:
            assert path in RANGES, (
                f"{path} is a number without a range: add it to RANGES in"
                " muxproxy/config/ranges.py (a timeout: _TIMEOUT, a count: _COUNT...)"
            )


def test_every_range_is_a_key_s() -> None:
    keys = {entry.path for entry in entries()}
    assert sorted(set(RANGES) - keys) == []


def test_a_concrete_path_is_its_pattern() -> None:
    assert pattern("upstreams.gpus.servers[12].weight") == "upstreams.NAME.servers[].weight"
    assert pattern('upstreams."a.b[0]".queue.max') == "upstreams.NAME.queue.max"
    assert pattern("routes[3].resume.window") == "routes[].resume.window"
    assert pattern("limits.stream_buffer") == "limits.stream_buffer"


# -- every key at the edges of its range ---------------------------------------------------

EXAMPLES = {entry.path: document for entry, document in iter_examples()}
INTEGER_KEYS = {
    f"{table.path}.{name}"
    for table in tables()
    for record, name, hint in numeric_fields()
    if table.record is record and name in table.keys and float not in {hint, *typing.get_args(hint)}
}
"""The keys whose record field is an ``int`` (the rest are seconds or ratios, floats)."""


def _name(path: str) -> str:
    """The name the reference's examples give the group or alias of ``path``."""
    return "chat-default" if path.startswith("models.") else "gpus"


def concrete(path: str) -> str:
    return path.replace("NAME", _name(path)).replace("[]", "[0]")


def document(path: str, value: Any) -> dict[str, Any]:
    """The reference's example of the key at ``path``, with ``value`` in its place."""
    data: dict[str, Any] = tomllib.loads(EXAMPLES[path])
    *tables_, key = path.split(".")
    node = data
    for part in tables_:
        if part == "NAME":
            node = node[_name(path)]
        elif part.endswith("[]"):
            node = node[part[:-2]][0]
        else:
            node = node[part]
    assert key in node, f"the example of {path} does not set it"
    node[key] = value
    return data


def problems(path: str, value: Any) -> list[str]:
    try:
        parse_config(document(path, value), environ={})
    except ConfigError as exc:
        return exc.problems
    return []


def number(path: str, value: int | float) -> int | float:
    return int(value) if path in INTEGER_KEYS else float(value)


def shown(value: int | float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


KEYS = sorted(RANGES)


@pytest.mark.parametrize("path", KEYS)
def test_the_top_of_the_range_loads(path: str) -> None:
    found = problems(path, number(path, RANGES[path].high))
    if path in CROSS_CHECKED:
        assert len(found) == 1 and CROSS_CHECKED[path] in found[0], found
    else:
        assert found == []


@pytest.mark.parametrize("path", KEYS)
def test_one_past_the_top_is_refused_naming_key_value_range_and_fix(path: str) -> None:
    limits = RANGES[path]
    if path in INTEGER_KEYS:
        past: int | float = int(limits.high) + 1
    else:
        past = math.nextafter(float(limits.high), math.inf)
    high = int(limits.high) if float(limits.high).is_integer() else limits.high
    found = problems(path, past)
    if path in OWN_BOUNDS:
        assert len(found) == 1 and found[0].startswith(f"{concrete(path)}: expected "), found
        assert OWN_BOUNDS[path] in found[0] and shown(past) in found[0], found
        return
    assert found == [
        f"{concrete(path)}: expected {limits.text}, got {shown(past)}; lower it to {high} or less"
    ]


@pytest.mark.parametrize("path", KEYS)
def test_the_bottom_of_the_range(path: str) -> None:
    limits = RANGES[path]
    low = number(path, limits.low)
    if limits.above_low:
        assert [p for p in problems(path, low) if p.startswith(f"{concrete(path)}: ")]
        return
    assert problems(path, low) == []
    below = low - 1 if isinstance(low, int) else math.nextafter(low, -math.inf)
    assert [p for p in problems(path, below) if p.startswith(f"{concrete(path)}: ")]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True], ids=str)
@pytest.mark.parametrize("path", KEYS)
def test_nan_infinity_and_booleans_are_refused(path: str, value: Any) -> None:
    found = problems(path, value)
    assert len(found) == 1 and found[0].startswith(f"{concrete(path)}: expected "), found


def in_range(limits: Range, value: Any) -> bool:
    return not isinstance(value, bool) and limits.contains(value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(KEYS),
    value=st.one_of(
        st.integers(min_value=-(2**80), max_value=2**80),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.sampled_from([10**6, 10**6 + 1, 86_400, 86_400.5, 2**30, 2**30 + 1, 2**64, 1e300]),
    ),
)
def test_what_loads_is_in_range_and_what_is_not_is_refused_by_name(path: str, value: Any) -> None:
    limits = RANGES[path]
    found = problems(path, value)
    mine = [p for p in found if p.startswith(f"{concrete(path)}: ")]
    if not found:
        assert in_range(limits, value), (path, value)
    if not in_range(limits, value):
        assert mine, (path, value, found)
    elif isinstance(value, int) or path not in INTEGER_KEYS:
        # In range, of the key's kind: only another rule may refuse it.
        assert not mine or path in PAIRED, (path, value, found)


# -- the operator's document ----------------------------------------------------------------


def test_docs_operations_lists_every_range_as_the_code_has_it() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    assert render_markdown() in text, (
        "docs/operations.md's numeric ranges are out of date: run scripts/config-reference"
    )
    assert with_table(text) == text
    for path in RANGES:
        assert f"| `{path}` | {RANGES[path].text} |" in text
