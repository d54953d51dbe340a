"""Tests of TOML configuration loading and validation (:mod:`muxproxy.config`)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from muxproxy.config import (
    Config,
    ConfigError,
    Limits,
    Listener,
    Route,
    Server,
    Timeouts,
    Upstream,
    address_problem,
    load_config,
    parse_config,
    parse_quick_config,
    quick_config,
)

MINIMAL = """\
[[listeners]]
address = "127.0.0.1:8080"

[upstreams.gpus]
servers = ["127.0.0.1:9001"]
"""

FULL = """\
[[listeners]]
address = "127.0.0.1:8080"

[[listeners]]
address = "[::1]:8443"
tls_cert = "cert.pem"
tls_key = "key.pem"

[timeouts]
connect = 2
response_head = 30.5
read = 120
send = 10
client_header = 5
keepalive_idle = 20

[limits]
stream_buffer = 131072
max_concurrent_streams = 50
max_request_head = 32768

[upstreams.gpus]
servers = ["127.0.0.1:9001", { address = "127.0.0.1:9002" }]
pool_max_idle = 0
pool_idle_timeout = 15

[upstreams.cpus]
servers = ["cpu-1.internal:8000"]

[[routes]]
prefix = "/v1/"
upstream = "gpus"

[[routes]]
prefix = "/"
upstream = "cpus"
"""


def valid() -> dict[str, Any]:
    """A minimal valid document, to break one key at a time."""
    return {
        "listeners": [{"address": "127.0.0.1:8080"}],
        "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
    }


def problems_of(data: dict[str, Any], **kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, **kwargs)
    return info.value.problems


def write(tmp_path: Path, text: str, name: str = "muxproxy.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- valid files ------------------------------------------------------------------------------


def test_minimal_file_gets_defaults_and_one_route(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    assert config == Config(
        listeners=(Listener(address="127.0.0.1:8080"),),
        upstreams={"gpus": Upstream(name="gpus", servers=(Server(address="127.0.0.1:9001"),))},
        routes=(Route(prefix="/", upstream="gpus"),),
    )
    assert config.timeouts == Timeouts()
    assert config.limits == Limits()
    assert config.route_for(b"/v1/chat/completions") is config.upstreams["gpus"]


def test_full_file(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("cert")
    (tmp_path / "key.pem").write_text("key")
    config = load_config(str(write(tmp_path, FULL)))

    plain, secure = config.listeners
    assert plain == Listener(address="127.0.0.1:8080")
    assert not plain.tls
    assert secure.address == "[::1]:8443"
    assert (secure.host, secure.port) == ("::1", 8443)
    assert secure.tls
    # Relative TLS paths are taken relative to the configuration file.
    assert secure.tls_cert == os.path.join(str(tmp_path), "cert.pem")
    assert secure.tls_key == os.path.join(str(tmp_path), "key.pem")

    assert config.timeouts == Timeouts(
        connect=2.0,
        response_head=30.5,
        read=120.0,
        send=10.0,
        client_header=5.0,
        keepalive_idle=20.0,
    )
    assert isinstance(config.timeouts.read, float)
    assert config.limits == Limits(
        stream_buffer=131072, max_concurrent_streams=50, max_request_head=32768
    )
    assert config.upstreams == {
        "gpus": Upstream(
            name="gpus",
            servers=(Server(address="127.0.0.1:9001"), Server(address="127.0.0.1:9002")),
            pool_max_idle=0,
            pool_idle_timeout=15.0,
        ),
        "cpus": Upstream(name="cpus", servers=(Server(address="cpu-1.internal:8000"),)),
    }
    assert config.routes == (
        Route(prefix="/v1/", upstream="gpus"),
        Route(prefix="/", upstream="cpus"),
    )
    assert config.route_for(b"/v1/completions") is config.upstreams["gpus"]
    assert config.route_for(b"/health") is config.upstreams["cpus"]


def test_parse_config_takes_a_dict() -> None:
    config = parse_config(valid())
    assert config.routes == (Route(prefix="/", upstream="gpus"),)


def test_absolute_tls_paths_are_kept(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("c")
    key.write_text("k")
    data = valid()
    data["listeners"][0].update(tls_cert=str(cert), tls_key=str(key))
    (listener,) = parse_config(data, base_dir="/nonexistent").listeners
    assert (listener.tls_cert, listener.tls_key) == (str(cert), str(key))


def test_listener_may_use_port_zero() -> None:
    data = valid()
    data["listeners"] = [{"address": "127.0.0.1:0"}, {"address": "127.0.0.1:0"}]
    assert [listener.port for listener in parse_config(data).listeners] == [0, 0]


def test_infinite_timeout_is_allowed() -> None:
    data = valid()
    data["timeouts"] = {"read": float("inf")}
    assert parse_config(data).timeouts.read == float("inf")


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:1", "localhost:65535", "gpu-1.example.com:8000", "[::1]:8080", "[fe80::1]:80"],
)
def test_valid_addresses(address: str) -> None:
    assert address_problem(address) is None


# --- one problem each -------------------------------------------------------------------------


def _set(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    target: Any = data
    for key in path[:-1]:
        target = target.setdefault(key, {}) if isinstance(target, dict) else target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            ("upstreams", "gpus", "servers"),
            ["127.0.0.1:9001", "localhost"],
            'upstreams.gpus.servers[1]: expected "host:port", got "localhost"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            ["127.0.0.1:70000"],
            'upstreams.gpus.servers[0]: expected "host:port" with a port in 1..65535,'
            ' got "127.0.0.1:70000"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            ["127.0.0.1:0"],
            'upstreams.gpus.servers[0]: expected "host:port" with a port in 1..65535,'
            ' got "127.0.0.1:0"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            ["h:http"],
            'upstreams.gpus.servers[0]: expected "host:port" with a port in 1..65535, got "h:http"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            ["::1:8080"],
            'upstreams.gpus.servers[0]: expected "host:port" with an IPv6 host in brackets,'
            ' e.g. "[::1]:8080", got "::1:8080"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            ["[nope]:8080"],
            'upstreams.gpus.servers[0]: expected "host:port" with an IPv6 host such as'
            ' "[::1]:8080", got "[nope]:8080"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            ["bad host:80"],
            'upstreams.gpus.servers[0]: expected "host:port" with a host name or IP address,'
            ' got "bad host:80"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            [9001],
            'upstreams.gpus.servers[0]: expected "host:port" or a table with address, got 9001',
        ),
        (
            ("upstreams", "gpus", "servers"),
            [{"address": 9001}],
            'upstreams.gpus.servers[0].address: expected "host:port", got 9001',
        ),
        (
            ("upstreams", "gpus", "servers"),
            [{"adress": "127.0.0.1:9001"}],
            'upstreams.gpus.servers[0].adress: unknown key; did you mean "address"?',
        ),
        (
            ("upstreams", "gpus", "servers"),
            [{"address": "127.0.0.1:9001", "weight": 2}],
            "upstreams.gpus.servers[0].weight: unknown key; expected one of: address",
        ),
        (
            ("upstreams", "gpus", "servers"),
            [],
            "upstreams.gpus.servers: expected at least one server, got an empty array",
        ),
        (
            ("upstreams", "gpus", "servers"),
            "127.0.0.1:9001",
            'upstreams.gpus.servers: expected an array of "host:port" strings or'
            ' { address = ... }, got "127.0.0.1:9001"',
        ),
        (
            ("upstreams", "gpus", "pool_max_idle"),
            -1,
            "upstreams.gpus.pool_max_idle: expected an integer >= 0, got -1",
        ),
        (
            ("upstreams", "gpus", "pool_idle_timeout"),
            0,
            "upstreams.gpus.pool_idle_timeout: expected a positive number of seconds, got 0",
        ),
        (
            ("upstreams", "gpus", "server"),
            ["127.0.0.1:9002"],
            'upstreams.gpus.server: unknown key; did you mean "servers"?',
        ),
        (
            ("upstreams", "gpus"),
            ["127.0.0.1:9001"],
            "upstreams.gpus: expected a table with servers = [...], got an array",
        ),
        (
            ("upstreams",),
            {"b.c": {"servers": ["nope"]}},
            'upstreams."b.c".servers[0]: expected "host:port", got "nope"',
        ),
        (
            ("timeouts", "read"),
            -3,
            "timeouts.read: expected a positive number of seconds, got -3",
        ),
        (
            ("timeouts", "connect"),
            "5s",
            'timeouts.connect: expected a positive number of seconds, got "5s"',
        ),
        (
            ("timeouts", "send"),
            True,
            "timeouts.send: expected a positive number of seconds, got true",
        ),
        (
            ("timeouts", "send"),
            float("nan"),
            "timeouts.send: expected a positive number of seconds, got nan",
        ),
        (("timeouts", "raed"), 3, 'timeouts.raed: unknown key; did you mean "read"?'),
        (("timeouts",), 30, "timeouts: expected a table, got 30"),
        (
            ("limits", "stream_buffer"),
            1.5,
            "limits.stream_buffer: expected a positive integer, got 1.5",
        ),
        (
            ("limits", "max_concurrent_streams"),
            0,
            "limits.max_concurrent_streams: expected a positive integer, got 0",
        ),
        (
            ("limits", "max_request_headers"),
            1,
            'limits.max_request_headers: unknown key; did you mean "max_request_head"?',
        ),
        (
            ("listeners", 0, "address"),
            "localhost",
            'listeners[0].address: expected "host:port", got "localhost"',
        ),
        (
            ("listeners", 0, "address"),
            "127.0.0.1:65536",
            'listeners[0].address: expected "host:port" with a port in 0..65535,'
            ' got "127.0.0.1:65536"',
        ),
        (
            ("listeners", 0, "port"),
            8080,
            "listeners[0].port: unknown key; expected one of: address, tls_cert, tls_key",
        ),
        (
            ("listeners",),
            {"address": "127.0.0.1:8080"},
            "listeners: expected an array of [[listeners]] tables, got a table",
        ),
        (
            ("listeners",),
            [],
            'listeners: expected at least one [[listeners]] table with address = "host:port",'
            " got an empty array",
        ),
        (("listener",), [], 'listener: unknown key; did you mean "listeners"?'),
        (
            ("upstreams",),
            {},
            "upstreams: expected at least one group, e.g. [upstreams.gpus]",
        ),
        (
            ("routes",),
            [{"prefix": "v1/", "upstream": "gpus"}],
            'routes[0].prefix: expected a path prefix starting with "/", got "v1/"',
        ),
        (
            ("routes",),
            [{"prefix": "/v1/", "upstream": "gpu"}],
            'routes[0].upstream: no upstream named "gpu"; define [upstreams.gpu]'
            " or use one of: gpus",
        ),
        (
            ("routes",),
            [{"prefix": "/"}],
            "routes[0].upstream: missing; expected the name of an upstream group",
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "weight": 1}],
            "routes[0].weight: unknown key; expected one of: prefix, upstream",
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus"}, {"prefix": "/", "upstream": "gpus"}],
            'routes[1].prefix: "/" is already routed by routes[0]',
        ),
    ],
)
def test_one_problem(path: tuple[Any, ...], value: Any, message: str) -> None:
    assert problems_of(_set(valid(), path, value)) == [message]


def test_missing_sections() -> None:
    assert problems_of({}) == [
        'listeners: missing; expected at least one [[listeners]] table with address = "host:port"',
        "upstreams: missing; expected at least one group, e.g. [upstreams.gpus]"
        ' with servers = ["127.0.0.1:9001"]',
    ]


def test_misspelled_section_is_not_also_reported_missing() -> None:
    data = valid()
    data["upstream"] = data.pop("upstreams")
    assert problems_of(data) == ['upstream: unknown key; did you mean "upstreams"?']


def test_missing_required_keys() -> None:
    data = {"listeners": [{}], "upstreams": {"gpus": {}}}
    assert problems_of(data) == [
        'listeners[0].address: missing; expected "host:port"',
        'upstreams.gpus.servers: missing; expected an array of "host:port" servers',
    ]


def test_routes_are_needed_with_several_groups() -> None:
    data = valid()
    data["upstreams"]["cpus"] = {"servers": ["127.0.0.1:9002"]}
    assert problems_of(data) == [
        "routes: missing; with several upstream groups (cpus, gpus) each request needs a"
        " route: add [[routes]] tables with prefix and upstream"
    ]


def test_unknown_upstream_lists_the_groups() -> None:
    data = valid()
    data["upstreams"] = {"b": {"servers": ["h:2"]}, "a": {"servers": ["h:1"]}}
    data["routes"] = [{"prefix": "/", "upstream": "gpu"}]
    assert problems_of(data) == [
        'routes[0].upstream: no upstream named "gpu"; define [upstreams.gpu] or use one of: a, b'
    ]


def test_unknown_upstream_when_no_group_is_defined() -> None:
    data = valid()
    data["upstreams"] = {}
    data["routes"] = [{"prefix": "/", "upstream": "gpu"}]
    assert problems_of(data) == [
        "upstreams: expected at least one group, e.g. [upstreams.gpus]",
        'routes[0].upstream: no upstream named "gpu"; define [upstreams.gpu]',
    ]


def test_route_to_an_invalid_group_reports_only_the_group() -> None:
    data = valid()
    data["upstreams"]["gpus"]["servers"] = ["nope"]
    data["routes"] = [{"prefix": "/", "upstream": "gpus"}]
    assert problems_of(data) == ['upstreams.gpus.servers[0]: expected "host:port", got "nope"']


def test_tls_needs_both_files(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("cert")
    data = valid()
    data["listeners"][0]["tls_cert"] = "cert.pem"
    assert problems_of(data, base_dir=str(tmp_path)) == [
        "listeners[0].tls_key: missing; tls_cert is set, and TLS needs both tls_cert and tls_key"
    ]
    data["listeners"][0] = {"address": "127.0.0.1:8443", "tls_key": "key.pem"}
    assert problems_of(data, base_dir=str(tmp_path)) == [
        f'listeners[0].tls_key: file not found: "{tmp_path / "key.pem"}"',
        "listeners[0].tls_cert: missing; tls_key is set, and TLS needs both tls_cert and tls_key",
    ]


def test_tls_files_must_exist(tmp_path: Path) -> None:
    data = valid()
    data["listeners"][0].update(tls_cert="cert.pem", tls_key=str(tmp_path))
    assert problems_of(data, base_dir=str(tmp_path)) == [
        f'listeners[0].tls_cert: file not found: "{tmp_path / "cert.pem"}"',
        f'listeners[0].tls_key: expected a file, got the directory "{tmp_path}"',
    ]


def test_duplicate_listener_address() -> None:
    data = valid()
    data["listeners"] = [{"address": "127.0.0.1:8080"}, {"address": "127.0.0.1:8080"}]
    assert problems_of(data) == [
        'listeners[1].address: "127.0.0.1:8080" is already used by listeners[0]'
    ]


# --- many problems at once --------------------------------------------------------------------


BAD = """\
[[listeners]]
address = "0.0.0.0:8080"
tls_cert = "cert.pem"

[timeouts]
raed = 30
connect = -3

[upstreams.gpus]
servers = ["127.0.0.1:9001", "localhost", { address = "10.0.0.5:9003", weight = 2 }]

[[routes]]
prefix = "/v1/"
upstream = "gpu"
"""


def test_all_problems_are_collected(tmp_path: Path) -> None:
    path = write(tmp_path, BAD)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    error = info.value
    assert error.source == str(path)
    assert error.problems == [
        f'listeners[0].tls_cert: file not found: "{tmp_path / "cert.pem"}"',
        "listeners[0].tls_key: missing; tls_cert is set, and TLS needs both tls_cert and tls_key",
        'timeouts.raed: unknown key; did you mean "read"?',
        "timeouts.connect: expected a positive number of seconds, got -3",
        'upstreams.gpus.servers[1]: expected "host:port", got "localhost"',
        "upstreams.gpus.servers[2].weight: unknown key; expected one of: address",
        'routes[0].upstream: no upstream named "gpu"; define [upstreams.gpu] or use one of: gpus',
    ]
    assert str(error).splitlines() == [
        f"{path}: invalid configuration",
        *(f"  {problem}" for problem in error.problems),
    ]


# --- files ------------------------------------------------------------------------------------


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[[listeners]]\naddress = "127.0.0.1:8080"\n[upstreams\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}, line 3, column ")
    assert "invalid TOML: " in problem


def test_toml_error_at_end_of_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'address = "127.0.0.1:8080')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}, line 1")
    assert "invalid TOML" in problem


def test_toml_duplicate_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "\n[upstreams.gpus]\nservers = []\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}, line 7, column ")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[[listeners]]\naddress = "caf\xe9:80"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"{path}, line 2: invalid TOML: not UTF-8 text"]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"{path}: no such file"]
    assert info.value.source == str(path)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert info.value.problems == [f"{tmp_path}: is a directory, expected a TOML file"]


def test_tls_paths_relative_to_the_config_file(tmp_path: Path, monkeypatch: Any) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "cert.pem").write_text("c")
    (conf / "key.pem").write_text("k")
    write(
        conf,
        '[[listeners]]\naddress = "127.0.0.1:8443"\ntls_cert = "cert.pem"\ntls_key = "key.pem"\n'
        '[upstreams.a]\nservers = ["127.0.0.1:1"]\n',
    )
    monkeypatch.chdir(tmp_path)
    (listener,) = load_config("conf/muxproxy.toml").listeners
    assert listener.tls_cert == os.path.join("conf", "cert.pem")
    assert os.path.isfile(listener.tls_cert)


# --- quick mode -------------------------------------------------------------------------------


def test_quick_config_valid() -> None:
    config = parse_quick_config("127.0.0.1:0", ["127.0.0.1:9001", "[::1]:9002"])
    assert config == quick_config("127.0.0.1:0", ["127.0.0.1:9001", "[::1]:9002"])
    assert config.routes == (Route(prefix="/", upstream="default"),)
    assert [s.port for s in config.upstreams["default"].servers] == [9001, 9002]


def test_quick_config_with_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("c")
    key.write_text("k")
    config = parse_quick_config(
        "127.0.0.1:8443", ["127.0.0.1:9001"], tls_cert=str(cert), tls_key=str(key)
    )
    assert config.listeners[0].tls


def test_quick_config_problems_name_the_flags(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_quick_config(
            "localhost", ["127.0.0.1:9001", "gpu:0"], tls_cert=str(tmp_path / "c.pem")
        )
    assert info.value.problems == [
        '--listen: expected "host:port", got "localhost"',
        '--upstream: expected "host:port" with a port in 1..65535, got "gpu:0"',
        f'--tls-cert: file not found: "{tmp_path / "c.pem"}"',
        "--tls-key: missing; --tls-cert is given, and TLS needs both --tls-cert and --tls-key",
    ]
    assert info.value.source is None


def test_quick_config_needs_an_upstream() -> None:
    with pytest.raises(ConfigError) as info:
        parse_quick_config("127.0.0.1:8080", [])
    assert info.value.problems == ['--upstream: missing; expected at least one "host:port"']
