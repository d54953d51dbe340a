"""The ``[log]`` section: defaults, valid values, and problems named by their key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from muxproxy.config import ConfigError, LogSettings, load_config, parse_config


def valid(**log: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "listeners": [{"address": "127.0.0.1:8080"}],
        "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
    }
    if log:
        data["log"] = log
    return data


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_no_log_section_means_stderr_text_info() -> None:
    assert parse_config(valid()).log == LogSettings(access="stderr", format="text", level="info")


def test_every_key_is_read() -> None:
    log = parse_config(valid(access="off", format="json", level="debug")).log
    assert log == LogSettings(access="off", format="json", level="debug")


def test_a_relative_access_file_is_taken_from_the_config_file_directory(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    path = tmp_path / "muxproxy.toml"
    path.write_text(
        '[[listeners]]\naddress = "127.0.0.1:8080"\n'
        '[upstreams.gpus]\nservers = ["127.0.0.1:9001"]\n'
        '[log]\naccess = "logs/access.log"\n'
    )
    assert load_config(path).log.access == str(tmp_path / "logs" / "access.log")


@pytest.mark.parametrize(
    ("log", "message"),
    [
        ({"format": "xml"}, 'log.format: expected "text" or "json", got "xml"'),
        (
            {"format": "JSON"},
            'log.format: expected "text" or "json", got "JSON"; did you mean "json"?',
        ),
        (
            {"level": "verbose"},
            'log.level: expected "debug", "info", "warning" or "error", got "verbose"',
        ),
        ({"access": ""}, 'log.access: expected "stderr", "off" or a file path, got ""'),
        ({"access": 1}, 'log.access: expected "stderr", "off" or a file path, got 1'),
        ({"acess": "off"}, 'log.acess: unknown key; did you mean "access"?'),
    ],
)
def test_one_problem(log: dict[str, Any], message: str) -> None:
    assert problems_of(valid(**log)) == [message]


def test_an_access_file_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "access.log"
    (problem,) = problems_of(valid(access=str(missing)))
    assert problem.startswith(f'log.access: the directory "{tmp_path / "nowhere"}" does not exist')


def test_a_directory_as_the_access_file_is_refused(tmp_path: Path) -> None:
    assert problems_of(valid(access=str(tmp_path))) == [
        f'log.access: expected a file, got the directory "{tmp_path}"'
    ]


def test_the_log_section_must_be_a_table() -> None:
    data = valid()
    data["log"] = "stderr"
    assert problems_of(data) == ['log: expected a table, got "stderr"']
