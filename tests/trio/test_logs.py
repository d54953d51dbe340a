"""``muxproxy.trio.logs``: the text and JSON lines, the access file, and the error log."""

from __future__ import annotations

import datetime
import enum
import io
import json
import logging
from pathlib import Path

import pytest

from muxproxy.config import LogSettings
from muxproxy.core.commands import Log
from muxproxy.core.observe.access import FIELDS
from muxproxy.trio.logs import LogSink, access_text, text_fields, text_value, timestamp

WALL = 1_777_777_777.0456  # 2026-05-03T03:09:37.045Z


def test_timestamp_is_iso_8601_utc_with_milliseconds() -> None:
    assert timestamp(WALL) == "2026-05-03T03:09:37.045Z"


@pytest.mark.parametrize(
    "wall",
    [
        WALL,
        WALL + 1.0,  # the next second: its own text, not the last one's
        WALL,  # and back
        1_777_777_777.9999996,  # rounds up into the next second
        1_777_777_777.0000004,
        1_777_777_777.0005,  # a millisecond's edge
        1_777_777_777.9995,
        0.0,
        0.9999995,  # half a microsecond: half to even
        -1.5,  # before the epoch: the second below
        4_102_444_800.25,  # 2100-01-01
    ],
)
def test_timestamp_is_the_datetime_of_the_wall_time(wall: float) -> None:
    moment = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    expected = moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    assert timestamp(wall) == expected


class _Code(enum.IntEnum):
    OK = 200


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (True, "true"),
        (200, "200"),
        (0.25, "0.25"),
        ("/v1/chat", "/v1/chat"),
        ("client aborted: reset", '"client aborted: reset"'),
        ("a\nb", '"a\\nb"'),  # a line stays one line
        ('say "hi"', '"say \\"hi\\""'),
        ("caf\xe9", '"caf\\u00e9"'),
        ("", '""'),
    ],
)
def test_text_values_never_split_a_line(value: object, text: str) -> None:
    assert text_value(value) == text


def test_text_fields_put_the_named_order_first() -> None:
    assert text_fields({"b": 1, "a": 2, "c": None}, ("a", "b")) == "a=2 b=1 c=-"


@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": "r-1", "status": 200, "outcome": "ok", "ttft": None},
        {"outcome": "ok", "client": "10.0.0.7", "ttfh": 0.000123, "tries": 1},  # out of order
        {"request_id": "r 1", "target": "/a\nb", "group": "", "trace_sampled": True},
        {"status": _Code.OK, "model": "caf\xe9", "bytes_in": 0, "events": 3.0},
        {"client": 'say "hi"', "target": "a\tb", "ttft": float("nan"), "tries": -1},
        {"request_id": "r-1", "client": "10.0.0.7"},  # the first fields, in order
        dict.fromkeys(FIELDS[:24], None),  # a record without telemetry's fields
        {**{key: 7 for key in FIELDS[:-1]}, "ttft": 0.25, "trace_sampled": True},  # with them
        {**dict.fromkeys(FIELDS, "x"), "trace_sampled": False, "session": ""},  # an empty text
        {**dict.fromkeys(FIELDS, 1e-06), "target": "/a b"},  # a text to quote
        {"request_id": "r-1", "extra": "x y", "status": 200, "more": None},  # not in FIELDS
        {},
    ],
)
def test_the_access_text_is_text_fields_in_the_access_order(fields: dict[str, object]) -> None:
    assert access_text(fields) == text_fields(fields, FIELDS)


def test_access_lines_in_both_formats() -> None:
    out = io.StringIO()
    fields = {"request_id": "r-1", "status": 200, "outcome": "ok", "ttft": None}
    LogSink(LogSettings(format="text"), stderr=out)(Log(event="access", fields=fields), WALL)
    LogSink(LogSettings(format="json"), stderr=out)(Log(event="access", fields=fields), WALL)
    text, js = out.getvalue().splitlines()
    assert text == "2026-05-03T03:09:37.045Z request_id=r-1 status=200 ttft=- outcome=ok"
    assert json.loads(js) == {"time": "2026-05-03T03:09:37.045Z", **fields}


def test_access_off_writes_nothing() -> None:
    out = io.StringIO()
    LogSink(LogSettings(access="off"), stderr=out)(Log(event="access", fields={"a": 1}), WALL)
    assert out.getvalue() == ""


def test_the_access_file_is_appended_to_and_reopened_on_reconfigure(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    path.write_text("earlier\n")
    sink = LogSink(LogSettings(access=str(path)))
    sink(Log(event="access", fields={"n": 1}), WALL)
    assert path.read_text().splitlines() == ["earlier", "2026-05-03T03:09:37.045Z n=1"]
    path.rename(tmp_path / "access.log.1")  # logrotate
    sink.reconfigure(LogSettings(access=str(path), format="json"))
    sink(Log(event="access", fields={"n": 2}), WALL)
    sink.close()
    assert [json.loads(line)["n"] for line in path.read_text().splitlines()] == [2]
    with pytest.raises(OSError):
        sink.reconfigure(LogSettings(access=str(tmp_path / "missing" / "x.log")))
    assert sink.settings.format == "json"  # the old settings stay


def test_error_log_levels_follow_the_event(caplog: pytest.LogCaptureFixture) -> None:
    sink = LogSink(LogSettings(access="off"))
    caplog.set_level(logging.DEBUG, logger="muxproxy")
    sink(Log(event="health", fields={"server": "s:1", "up": False}), WALL)
    sink(Log(event="health", fields={"server": "s:1", "up": True}), WALL)
    sink(Log(event="internal_error", fields={"error": "boom", "traceback": "Trace\n  line"}), WALL)
    sink(Log(event="request_body_timeout", fields={"client": "10.0.0.1"}), WALL)
    got = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert got == [
        ("WARNING", "health server=s:1 up=false"),
        ("INFO", "health server=s:1 up=true"),
        ("ERROR", "internal_error error=boom\nTrace\n  line"),
        ("WARNING", "request_body_timeout client=10.0.0.1"),
    ]
