"""The ``[telemetry]`` table: its checks, and the refusal without the optional extra."""

from __future__ import annotations

from typing import Any

import pytest

from muxproxy.config import ConfigError, parse_config, telemetrykeys

BASE: dict[str, Any] = {
    "listeners": [{"address": "127.0.0.1:0"}],
    "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
}


def load(telemetry: dict[str, Any]) -> Any:
    return parse_config({**BASE, "telemetry": telemetry}, environ={})


def problems(telemetry: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(telemetry)
    return caught.value.problems


def test_a_full_table_loads_and_its_headers_stay_out_of_its_repr() -> None:
    config = load(
        {
            "otlp_endpoint": "https://collector.example:4318/",
            "service_name": "edge",
            "export_interval": 2,
            "headers": {"Authorization": "Bearer s3cret"},
            "sample_ratio": 0.25,
        }
    )
    settings = config.telemetry
    assert settings.otlp_endpoint == "https://collector.example:4318"
    assert settings.headers == (("Authorization", "Bearer s3cret"),)
    assert (settings.service_name, settings.export_interval, settings.sample_ratio) == (
        "edge",
        2.0,
        0.25,
    )
    assert "s3cret" not in repr(config)


def test_no_table_no_telemetry() -> None:
    assert parse_config(BASE, environ={}).telemetry is None


@pytest.mark.parametrize(
    ("table", "found"),
    [
        ({}, "telemetry.otlp_endpoint: missing"),
        ({"otlp_endpoint": "collector:4318"}, "telemetry.otlp_endpoint: expected an http(s) URL"),
        ({"otlp_endpoint": "ftp://c:4318"}, "telemetry.otlp_endpoint: expected an http(s) URL"),
        ({"otlp_endpoint": "http://c:99999"}, "telemetry.otlp_endpoint: expected an http(s) URL"),
        ({"otlp_endpoint": "http://c:4318/?a=1"}, "without a query"),
        ({"otlp_endpoint": "http://c", "sample_ratio": 1.5}, "telemetry.sample_ratio"),
        ({"otlp_endpoint": "http://c", "sample_ratio": True}, "telemetry.sample_ratio"),
        ({"otlp_endpoint": "http://c", "export_interval": 0}, "telemetry.export_interval"),
        ({"otlp_endpoint": "http://c", "service_name": " "}, "telemetry.service_name"),
        ({"otlp_endpoint": "http://c", "headers": {"a b": "x"}}, "telemetry.headers.a b"),
    ],
)
def test_a_bad_table_is_refused_naming_the_key(table: dict[str, Any], found: str) -> None:
    assert any(found in problem for problem in problems(table)), problems(table)


def test_a_header_value_with_a_line_break_is_refused_without_showing_it() -> None:
    (problem,) = problems({"otlp_endpoint": "http://c", "headers": {"X-Key": "s3cret\r\nX: y"}})
    assert problem.startswith("telemetry.headers.X-Key:") and "s3cret" not in problem


def test_without_the_extra_the_table_is_refused_with_the_pip_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(telemetrykeys, "OTEL_MODULES", ("opentelemetry_not_installed.sdk",))
    (problem,) = problems({"otlp_endpoint": "http://collector:4318"})
    assert "optional extra otel" in problem and "pip install 'muxproxy[otel]'" in problem
