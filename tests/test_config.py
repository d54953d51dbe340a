"""Tests of TOML configuration loading and validation (:mod:`muxproxy.config`)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import trustme

from muxproxy.config import (
    Api,
    Balance,
    Config,
    ConfigError,
    GroupTimeouts,
    HeaderRule,
    HealthCheck,
    Limits,
    Listener,
    NextUpstream,
    Resume,
    Route,
    Server,
    SessionSource,
    Sticky,
    StickyCookie,
    Timeouts,
    Upstream,
    address_problem,
    load_config,
    parse_config,
    parse_quick_config,
    quick_config,
)
from muxproxy.config.storeurl import SentinelStore, parse_sentinel

STORE_EXPECTED = (
    'expected a Redis URL such as "redis://127.0.0.1:6379/0" (or "rediss://" for TLS),'
    ' or a Sentinel URL such as "redis+sentinel://127.0.0.1:26379/mymaster/0";'
    " Cluster stores are not supported"
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
shutdown_grace = 90

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


def test_trusted_proxies_are_networks_and_default_to_none() -> None:
    assert parse_config(valid()).listeners[0].trusted_proxies == ()
    data = valid()
    data["listeners"][0]["trusted_proxies"] = ["10.0.0.0/8", "127.0.0.1", "2001:db8::/32"]
    (listener,) = parse_config(data).listeners
    assert [str(network) for network in listener.trusted_proxies] == [
        "10.0.0.0/8",
        "127.0.0.1/32",
        "2001:db8::/32",
    ]


def test_a_trusted_proxies_entry_that_is_not_a_cidr_is_named_with_its_fix() -> None:
    data = valid()
    data["listeners"][0]["trusted_proxies"] = ["10.0.0.1/8", "10.0.0.300/8", 10, "10.0.0.0/8"]
    assert problems_of(data) == [
        'listeners[0].trusted_proxies[0]: "10.0.0.1/8" has host bits set; write "10.0.0.0/8"',
        'listeners[0].trusted_proxies[1]: expected a CIDR such as "10.0.0.0/8" or an address'
        ' such as "10.0.0.1", got "10.0.0.300/8"',
        'listeners[0].trusted_proxies[2]: expected a CIDR such as "10.0.0.0/8", got 10',
    ]
    data["listeners"][0]["trusted_proxies"] = "10.0.0.0/8"
    assert problems_of(data) == [
        "listeners[0].trusted_proxies: expected an array of CIDRs, e.g."
        ' ["10.0.0.0/8", "127.0.0.1/32"], got "10.0.0.0/8"'
    ]


def write_tls_pair(directory: Path, cert: str = "cert.pem", key: str = "key.pem") -> None:
    """A real certificate and its private key, PEM, as ``directory/cert`` and ``directory/key``."""
    issued = trustme.CA().issue_cert("localhost")
    issued.cert_chain_pems[0].write_to_path(str(directory / cert))
    issued.private_key_pem.write_to_path(str(directory / key))


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
    assert config.route_for(b"/v1/chat/completions") == Route(prefix="/", upstream="gpus")


def test_full_file(tmp_path: Path) -> None:
    write_tls_pair(tmp_path)
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
        shutdown_grace=90.0,
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
    assert config.route_for(b"/v1/completions") is config.routes[0]
    assert config.route_for(b"/health") is config.routes[1]


def test_route_for_without_a_matching_prefix() -> None:
    data = valid()
    data["routes"] = [{"prefix": "/v1/", "upstream": "gpus"}]
    assert parse_config(data).route_for(b"/health") is None


def test_route_api_openai() -> None:
    data = valid()
    data["routes"] = [
        {"prefix": "/v1/", "upstream": "gpus", "api": "openai"},
        {"prefix": "/", "upstream": "gpus"},
    ]
    config = parse_config(data)
    assert config.routes[0].api is Api.OPENAI
    assert config.routes[1].api is None


def test_parse_config_takes_a_dict() -> None:
    config = parse_config(valid())
    assert config.routes == (Route(prefix="/", upstream="gpus"),)


def test_absolute_tls_paths_are_kept(tmp_path: Path) -> None:
    write_tls_pair(tmp_path, "c.pem", "k.pem")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    data = valid()
    data["listeners"][0].update(tls_cert=str(cert), tls_key=str(key))
    (listener,) = parse_config(data, base_dir="/nonexistent").listeners
    assert (listener.tls_cert, listener.tls_key) == (str(cert), str(key))


def test_listener_may_use_port_zero() -> None:
    data = valid()
    data["listeners"] = [{"address": "127.0.0.1:0"}, {"address": "127.0.0.1:0"}]
    assert [listener.port for listener in parse_config(data).listeners] == [0, 0]


@pytest.mark.parametrize(
    ("value", "shown"),
    [(float("inf"), "inf"), (float("nan"), "nan"), (1e400, "inf"), (10**400, "1" + "0" * 400)],
    ids=["inf", "nan", "1e400", "10**400"],
)
@pytest.mark.parametrize(
    "path",
    [
        ("timeouts", "read"),
        ("upstreams", "gpus", "pool_idle_timeout"),
        ("upstreams", "gpus", "sticky", "cookie", "expires"),
        ("upstreams", "gpus", "timeouts", "first_token"),
    ],
)
def test_infinite_and_nan_durations_are_refused(
    path: tuple[str, ...], value: float, shown: str
) -> None:
    """A duration becomes a timer deadline or a cookie's Max-Age (``math.ceil(inf)`` raises
    inside the core): each must be a finite number, and the message names the key."""
    data = _set(valid(), path, value)
    assert problems_of(data) == [
        f"{'.'.join(path)}: expected a positive, finite number of seconds, got {shown}"
    ]


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
            [{"address": "127.0.0.1:9001", "colour": 2}],
            "upstreams.gpus.servers[0].colour: unknown key; expected one of: address, weight,"
            " max_fails, fail_timeout, backup, protocol, max_connections, tls, tls_ca,"
            " tls_server_name, max_streams, max_waiting, kv_events",
        ),
        (
            ("upstreams", "gpus", "servers"),
            [{"address": "127.0.0.1:9001", "tls": "yes"}],
            'upstreams.gpus.servers[0].tls: expected true or false (a TOML boolean), got "yes"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            [{"address": "127.0.0.1:9001", "tls": True, "tls_ca": "/nonexistent/ca.pem"}],
            'upstreams.gpus.servers[0].tls_ca: file not found: "/nonexistent/ca.pem"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            [{"address": "127.0.0.1:9001", "protocol": "http2"}],
            'upstreams.gpus.servers[0].protocol: expected "h1" (HTTP/1.1) or "h2" (HTTP/2: h2c,'
            ' or TLS with ALPN when tls = true), got "http2"',
        ),
        (
            ("upstreams", "gpus", "servers"),
            [{"address": "127.0.0.1:9001", "protocol": "h2", "max_connections": 0}],
            "upstreams.gpus.servers[0].max_connections: expected an integer >= 1 (h2"
            " connections to this server), got 0",
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
            "upstreams.gpus.pool_idle_timeout:"
            " expected a positive, finite number of seconds, got 0",
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
            "timeouts.read: expected a positive, finite number of seconds, got -3",
        ),
        (
            ("timeouts", "connect"),
            "5s",
            'timeouts.connect: expected a positive, finite number of seconds, got "5s"',
        ),
        (
            ("timeouts", "send"),
            True,
            "timeouts.send: expected a positive, finite number of seconds, got true",
        ),
        (
            ("timeouts", "send"),
            float("nan"),
            "timeouts.send: expected a positive, finite number of seconds, got nan",
        ),
        (
            ("timeouts", "shutdown_grace"),
            0,
            "timeouts.shutdown_grace: expected a positive, finite number of seconds, got 0",
        ),
        (
            ("timeouts", "shutdown_grace"),
            "30s",
            'timeouts.shutdown_grace: expected a positive, finite number of seconds, got "30s"',
        ),
        (
            ("timeouts", "shutdown_grac"),
            3,
            'timeouts.shutdown_grac: unknown key; did you mean "shutdown_grace"?',
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
            "listeners[0].port: unknown key; expected one of: address, tls_cert, tls_key,"
            " trusted_proxies",
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
            [{"prefix": "/", "upstream": "gpus", "colour": 1}],
            "routes[0].colour: unknown key; expected one of: prefix, upstream,"
            " retry_until_first_event, sse_heartbeat, continue_on_failure, resume, api, models",
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "api": "OpenAI"}],
            'routes[0].api: expected "openai", got "OpenAI"; did you mean "openai"?',
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "api": "anthropic"}],
            'routes[0].api: expected "openai", got "anthropic"',
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus"}, {"prefix": "/", "upstream": "gpus"}],
            'routes[1].prefix: "/" is already routed by routes[0]; give one of them'
            " models = [...] to route the prefix by model",
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "resume": {"window": "256 kb"}}],
            "routes[0].resume.window: expected a positive size: bytes, or a string such as"
            ' "256 KiB" or "1 MiB" (units B, KiB, MiB, GiB), got "256 kb"',
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "resume": {"window": 100}}],
            "routes[0].resume.window: expected 4096 to 1073741824 bytes (at least a few events;"
            " at most 1 GiB held for one stream), got 100; raise it to 4096 or more",
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "resume": {"linger": 0}}],
            "routes[0].resume.linger: expected a positive, finite number of seconds, got 0",
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "resume": False}],
            'routes[0].resume: expected true or a table such as { window = "256 KiB",'
            " linger = 30 }; leave the key out to turn resume off",
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "resume": {"credential_headers": "x-api-key"}}],
            "routes[0].resume.credential_headers: expected a list of header names such as"
            ' ["authorization", "x-api-key"], got "x-api-key"',
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "resume": {"credential_headers": ["x api"]}}],
            "routes[0].resume.credential_headers[0]: expected a list of header names such as"
            ' ["authorization", "x-api-key"]; each a token (letters, digits and'
            ' !#$%&\'*+-.^_`|~), got "x api"',
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "resume": {"lease": 0.5}}],
            "routes[0].resume.lease: expected 1 to 300 seconds (5 minutes: renewed every third"
            " of it, a dead owner's readers wait for it), got 0.5; raise it to 1 or more",
        ),
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "resume": {"lingr": 3}}],
            'routes[0].resume.lingr: unknown key; did you mean "linger"?',
        ),
        *(
            (
                ("routes",),
                [{"prefix": "/", "upstream": "gpus", "resume": {"store": store}}],
                f"routes[0].resume.store: {STORE_EXPECTED}, got {store!r}",
            )
            for store in (
                "redis-cluster://10.0.0.1:7000",
                "http://127.0.0.1:6379",
                "redis://",
                "redis://127.0.0.1:6379/x",
                "redis://127.0.0.1:99999/0",
                "redis://127.0.0.1:6379/0?protocol=3",
            )
        ),
        *(
            (
                ("routes",),
                [{"prefix": "/", "upstream": "gpus", "resume": {"store": store}}],
                f"routes[0].resume.store: {STORE_EXPECTED}: {why}, got {store!r}",
            )
            for store, why in (
                ("redis+sentinel://", "expected host:port for each Sentinel, got ''"),
                (
                    "redis+sentinel://10.0.0.1/mymaster",
                    "expected host:port for each Sentinel, got '10.0.0.1'",
                ),
                (
                    "redis+sentinel://10.0.0.1:26379,:26380/mymaster",
                    "expected host:port for each Sentinel, got ':26380'",
                ),
                (
                    "redis+sentinel://10.0.0.1:99999/mymaster",
                    "expected host:port for each Sentinel, got '10.0.0.1:99999'",
                ),
                (
                    "redis+sentinel://10.0.0.1:26379",
                    "the service name (as in sentinel monitor) is missing",
                ),
                (
                    "redis+sentinel://10.0.0.1:26379/",
                    "the service name (as in sentinel monitor) is missing",
                ),
                (
                    "redis+sentinel://10.0.0.1:26379/mymaster/x",
                    "the db must be an integer, got 'x'",
                ),
                (
                    "redis+sentinel://10.0.0.1:26379/mymaster/0/1",
                    "the db must be an integer, got '0/1'",
                ),
                (
                    "redis+sentinel://10.0.0.1:26379/mymaster?db=1",
                    "no query or fragment is taken",
                ),
                (
                    "rediss+sentinel://10.0.0.1:26379/mymaster",
                    "TLS to Sentinel (rediss+sentinel://) is not supported",
                ),
            )
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
        'upstreams.gpus.servers: missing; expected an array of "host:port" servers (or'
        ' discover = { dns = "NAME", port = 8000 } to find them in DNS)',
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
servers = ["127.0.0.1:9001", "localhost", { address = "10.0.0.5:9003", wieght = 2 }]

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
        "timeouts.connect: expected a positive, finite number of seconds, got -3",
        'upstreams.gpus.servers[1]: expected "host:port", got "localhost"',
        'upstreams.gpus.servers[2].wieght: unknown key; did you mean "weight"?',
        'routes[0].upstream: no upstream named "gpu"; define [upstreams.gpu] or use one of: gpus',
    ]
    assert str(error).splitlines() == [
        f"{path}: invalid configuration",
        *(f"  {problem}" for problem in error.problems),
    ]


# --- routing: servers, balancing, stickiness, retries, health checks, headers ----------------


ROUTING = """\
[[listeners]]
address = "127.0.0.1:8080"

[upstreams.gpus]
servers = [
  "127.0.0.1:9001",                                   # still allowed
  { address = "127.0.0.1:9002", weight = 5, max_fails = 3, fail_timeout = 30, backup = false },
  { address = "127.0.0.1:9003", weight = 0 },
  { address = "[::1]:9004", backup = true },
]
balance = "least_streams"

[upstreams.gpus.set_headers]
"X-Chat-ID" = "$session_key"
"X-User-ID" = "$arg_user"
Via-Edge = "mux $remote_addr"

[upstreams.gpus.sticky]
sources = ["cookie:chat_session", "header:X-Chat-ID", "query:session", "body:metadata.session_id"]
body_limit = 65536
session_idle = 900

[upstreams.gpus.sticky.cookie]
name = "mux_srv"
expires = 3600
domain = "example.com"
path = "/v1/"
http_only = false
secure = true
same_site = "None"
secret = "s3cret"

[upstreams.gpus.next_upstream]
on = ["error", "timeout", "http_502", "http_503"]
tries = 4
tries_timeout = 12.5
replay_buffer = 0

[upstreams.gpus.health_check]
path = "/health"
interval = 5
timeout = 2
passes = 3
fails = 1
expect_status = 204

[upstreams.gpus.timeouts]
connect = 2
response_head = 30
first_token = 120
idle = 300

[upstreams.cpus]
servers = ["127.0.0.1:9005"]

[[routes]]
prefix = "/v1/"
upstream = "gpus"
retry_until_first_event = true

[[routes]]
prefix = "/"
upstream = "cpus"
retry_until_first_event = false
"""


def test_routing_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ROUTING))
    gpus = config.upstreams["gpus"]
    assert gpus == Upstream(
        name="gpus",
        servers=(
            Server(address="127.0.0.1:9001"),
            Server(address="127.0.0.1:9002", weight=5, max_fails=3, fail_timeout=30.0),
            Server(address="127.0.0.1:9003", weight=0),
            Server(address="[::1]:9004", backup=True),
        ),
        balance=Balance.LEAST_STREAMS,
        sticky=Sticky(
            sources=(
                SessionSource(kind="cookie", name="chat_session"),
                SessionSource(kind="header", name="x-chat-id"),  # header names: lower case
                SessionSource(kind="query", name="session"),
                SessionSource(kind="body", name="metadata.session_id"),
            ),
            body_limit=65536,
            session_idle=900.0,
            cookie=StickyCookie(
                name="mux_srv",
                expires=3600.0,
                domain="example.com",
                path="/v1/",
                http_only=False,
                secure=True,
                same_site="None",
                secret="s3cret",
            ),
        ),
        next_upstream=NextUpstream(
            on=frozenset({"error", "timeout", "http_502", "http_503"}),
            tries=4,
            tries_timeout=12.5,
            replay_buffer=0,
        ),
        health_check=HealthCheck(
            path="/health", interval=5.0, timeout=2.0, passes=3, fails=1, expect_status=204
        ),
        set_headers=(
            HeaderRule(name="x-chat-id", value="$session_key"),
            HeaderRule(name="x-user-id", value="$arg_user"),
            HeaderRule(name="via-edge", value="mux $remote_addr"),
        ),
        timeouts=GroupTimeouts(connect=2.0, response_head=30.0, first_token=120.0, idle=300.0),
    )
    assert all(isinstance(s.fail_timeout, float) for s in gpus.servers)
    assert isinstance(gpus.sticky.cookie and gpus.sticky.cookie.expires, float)
    # A group without the new tables gets the record defaults.
    assert config.upstreams["cpus"] == Upstream(
        name="cpus", servers=(Server(address="127.0.0.1:9005"),)
    )
    assert config.routes == (
        Route(prefix="/v1/", upstream="gpus", retry_until_first_event=True),
        Route(prefix="/", upstream="cpus", retry_until_first_event=False),
    )
    assert config.route_for(b"/v1/chat/completions") is config.routes[0]


def test_route_sse_heartbeat_is_seconds() -> None:
    data = valid()
    data["routes"] = [{"prefix": "/", "upstream": "gpus", "sse_heartbeat": 15}]
    (route,) = parse_config(data).routes
    assert route.sse_heartbeat == 15.0 and isinstance(route.sse_heartbeat, float)
    assert parse_config(valid()).routes[0].sse_heartbeat is None
    data["routes"][0]["sse_heartbeat"] = 0
    assert problems_of(data) == [
        "routes[0].sse_heartbeat: expected a positive, finite number of seconds, got 0"
    ]


def test_routing_tables_alone_get_their_defaults() -> None:
    data = valid()
    data["upstreams"]["gpus"].update(
        sticky={"cookie": {}}, next_upstream={}, health_check={}, timeouts={}, set_headers={}
    )
    group = parse_config(data).upstreams["gpus"]
    assert group.sticky == Sticky(cookie=StickyCookie())
    assert group.next_upstream == NextUpstream()
    assert group.health_check == HealthCheck()
    assert group.timeouts == GroupTimeouts()
    assert group.set_headers == ()


def test_every_primary_may_be_draining() -> None:
    data = valid()
    data["upstreams"]["gpus"]["servers"] = [
        {"address": "127.0.0.1:9001", "weight": 0},
        {"address": "127.0.0.1:9002", "backup": True},
    ]
    servers = parse_config(data).upstreams["gpus"].servers
    assert [(s.weight, s.backup) for s in servers] == [(0, False), (1, True)]


def test_next_upstream_may_retry_on_nothing() -> None:
    data = valid()
    data["upstreams"]["gpus"]["next_upstream"] = {"on": [], "tries": 1}
    assert parse_config(data).upstreams["gpus"].next_upstream == NextUpstream(
        on=frozenset(), tries=1
    )


def test_set_headers_may_use_session_key_with_sources() -> None:
    data = valid()
    data["upstreams"]["gpus"]["sticky"] = {"sources": ["header:x-chat-id"]}
    data["upstreams"]["gpus"]["set_headers"] = {"X-Session": "s=$session_key;u=$http_x_user"}
    (rule,) = parse_config(data).upstreams["gpus"].set_headers
    assert rule == HeaderRule(name="x-session", value="s=$session_key;u=$http_x_user")


G = ("upstreams", "gpus")
S = (*G, "servers")
TOKEN_CHARS = "letters, digits and !#$%&'*+-.^_`|~"
SOURCE_EXPECTED = (
    'expected "kind:name" with kind cookie, header, query or body, e.g. "header:X-Chat-ID"'
)
VARIABLES = "$session_key, $remote_addr, $arg_NAME, $cookie_NAME or $http_NAME"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        # servers
        (
            S,
            [{"address": "127.0.0.1:9001", "weight": -1}],
            "upstreams.gpus.servers[0].weight: expected an integer >= 0 (0 drains the server),"
            " got -1",
        ),
        (
            S,
            [{"address": "127.0.0.1:9001", "weight": 1.5}],
            "upstreams.gpus.servers[0].weight: expected an integer >= 0 (0 drains the server),"
            " got 1.5",
        ),
        (
            S,
            [{"address": "127.0.0.1:9001", "max_fails": -2}],
            "upstreams.gpus.servers[0].max_fails: expected an integer >= 0"
            " (0: never take it out), got -2",
        ),
        (
            S,
            [{"address": "127.0.0.1:9001", "fail_timeout": 0}],
            "upstreams.gpus.servers[0].fail_timeout:"
            " expected a positive, finite number of seconds, got 0",
        ),
        (
            S,
            [{"address": "127.0.0.1:9001", "backup": "no"}],
            'upstreams.gpus.servers[0].backup: expected true or false (a TOML boolean), got "no"',
        ),
        (
            S,
            [{"address": "127.0.0.1:9001", "backup": 0}],
            "upstreams.gpus.servers[0].backup: expected true or false (a TOML boolean), got 0",
        ),
        (
            S,
            [{"address": "127.0.0.1:9001", "backup": True}, {"address": "h:1", "backup": True}],
            "upstreams.gpus.servers: every server is a backup; expected at least one primary"
            " server to take the traffic: set backup = false on one of them, or add one",
        ),
        (
            S,
            ["127.0.0.1:9001", {"address": "127.0.0.1:9001", "weight": 3}],
            'upstreams.gpus.servers[1]: "127.0.0.1:9001" is already listed at'
            " upstreams.gpus.servers[0]; list a server once, and give it a larger weight for a"
            " larger share",
        ),
        # balance
        (
            (*G, "balance"),
            "least_stream",
            'upstreams.gpus.balance: expected "round_robin", "least_streams" or "least_load",'
            ' got "least_stream"; did you mean "least_streams"?',
        ),
        (
            (*G, "balance"),
            "ROUND_ROBIN",
            'upstreams.gpus.balance: expected "round_robin", "least_streams" or "least_load",'
            ' got "ROUND_ROBIN"; did you mean "round_robin"?',
        ),
        (
            (*G, "balance"),
            "random",
            'upstreams.gpus.balance: expected "round_robin", "least_streams" or "least_load",'
            ' got "random"',
        ),
        (
            (*G, "balancing"),
            "round_robin",
            'upstreams.gpus.balancing: unknown key; did you mean "balance"?',
        ),
        # sticky
        ((*G, "sticky"), "cookie", 'upstreams.gpus.sticky: expected a table, got "cookie"'),
        (
            (*G, "sticky", "source"),
            [],
            'upstreams.gpus.sticky.source: unknown key; did you mean "sources"?',
        ),
        (
            (*G, "sticky", "sources"),
            "cookie:chat",
            'upstreams.gpus.sticky.sources: expected an array of "kind:name" strings,'
            ' got "cookie:chat"',
        ),
        (
            (*G, "sticky", "sources"),
            ["chat_session"],
            f'upstreams.gpus.sticky.sources[0]: {SOURCE_EXPECTED}, got "chat_session"',
        ),
        (
            (*G, "sticky", "sources"),
            ["cookies:chat"],
            f'upstreams.gpus.sticky.sources[0]: unknown kind "cookies"; {SOURCE_EXPECTED},'
            ' got "cookies:chat"; did you mean "cookie:chat"?',
        ),
        (
            (*G, "sticky", "sources"),
            ["header:X Chat"],
            'upstreams.gpus.sticky.sources[0]: expected "header:NAME" with NAME a header name'
            f' (a token: {TOKEN_CHARS}), got "header:X Chat"',
        ),
        (
            (*G, "sticky", "sources"),
            ["cookie:"],
            'upstreams.gpus.sticky.sources[0]: expected "cookie:NAME" with NAME a cookie name'
            f' (a token: {TOKEN_CHARS}), got "cookie:"',
        ),
        (
            (*G, "sticky", "sources"),
            ["query:a&b"],
            'upstreams.gpus.sticky.sources[0]: expected "query:NAME" with NAME a query argument'
            ' name (no spaces, "&", "=" or "#"), got "query:a&b"',
        ),
        (
            (*G, "sticky", "sources"),
            ["body:metadata..session-id"],
            'upstreams.gpus.sticky.sources[0]: expected "body:NAME" with NAME a dotted path of'
            ' JSON object keys, each an identifier, e.g. "metadata.session_id",'
            ' got "body:metadata..session-id"',
        ),
        (
            (*G, "sticky", "sources"),
            ["header:X-Chat-ID", "query:s", "header:x-chat-id"],
            'upstreams.gpus.sticky.sources[2]: "header:x-chat-id" is already listed at'
            " upstreams.gpus.sticky.sources[0]; remove one",
        ),
        (
            (*G, "sticky", "body_limit"),
            0,
            "upstreams.gpus.sticky.body_limit: expected a positive integer, got 0",
        ),
        (
            (*G, "sticky", "session_idle"),
            0,
            "upstreams.gpus.sticky.session_idle: expected a positive, finite number of"
            " seconds, got 0",
        ),
        # sticky cookie
        (
            (*G, "sticky", "cookie", "name"),
            "mux srv",
            "upstreams.gpus.sticky.cookie.name: expected a cookie name"
            f' (a token: {TOKEN_CHARS}), got "mux srv"',
        ),
        (
            (*G, "sticky", "cookie", "expires"),
            -1,
            "upstreams.gpus.sticky.cookie.expires:"
            " expected a positive, finite number of seconds, got -1",
        ),
        (
            (*G, "sticky", "cookie", "domain"),
            "exa mple.com",
            'upstreams.gpus.sticky.cookie.domain: expected a domain such as "example.com",'
            ' got "exa mple.com"',
        ),
        (
            (*G, "sticky", "cookie", "path"),
            "v1",
            'upstreams.gpus.sticky.cookie.path: expected a path starting with "/", without ";"'
            ' or control characters, got "v1"',
        ),
        (
            (*G, "sticky", "cookie", "http_only"),
            "true",
            "upstreams.gpus.sticky.cookie.http_only: expected true or false (a TOML boolean),"
            ' got "true"',
        ),
        (
            (*G, "sticky", "cookie", "same_site"),
            "lax",
            'upstreams.gpus.sticky.cookie.same_site: expected "Strict", "Lax" or "None",'
            ' got "lax"; did you mean "Lax"?',
        ),
        (
            (*G, "sticky", "cookie", "same_site"),
            "None",
            'upstreams.gpus.sticky.cookie.same_site: "None" needs secure = true (browsers drop'
            ' SameSite=None cookies without Secure); set secure = true, or use "Lax"',
        ),
        (
            (*G, "sticky", "cookie", "secret"),
            42,
            "upstreams.gpus.sticky.cookie.secret: expected a string, got 42",
        ),
        (
            (*G, "sticky", "cookie", "max_age"),
            60,
            "upstreams.gpus.sticky.cookie.max_age: unknown key; expected one of: name, expires,"
            " domain, path, http_only, secure, same_site, secret",
        ),
        # next_upstream
        (
            (*G, "next_upstream", "on"),
            "error",
            "upstreams.gpus.next_upstream.on: expected an array of conditions (error, timeout,"
            ' http_429, http_502, http_503, http_504), got "error"',
        ),
        (
            (*G, "next_upstream", "on"),
            ["error", "timout"],
            'upstreams.gpus.next_upstream.on[1]: expected "error", "timeout", "http_429",'
            ' "http_502", "http_503" or "http_504", got "timout"; did you mean "timeout"?',
        ),
        (
            (*G, "next_upstream", "on"),
            ["http_404"],
            'upstreams.gpus.next_upstream.on[0]: expected "error", "timeout", "http_429",'
            ' "http_502", "http_503" or "http_504", got "http_404"; only 429, 502, 503 and 504'
            " responses can be retried",
        ),
        (
            (*G, "next_upstream", "on"),
            ["error", 502],
            'upstreams.gpus.next_upstream.on[1]: expected "error", "timeout", "http_429",'
            ' "http_502", "http_503" or "http_504", got 502',
        ),
        (
            (*G, "next_upstream", "tries"),
            0,
            "upstreams.gpus.next_upstream.tries: expected a positive integer, got 0",
        ),
        (
            (*G, "next_upstream", "tries_timeout"),
            -1,
            "upstreams.gpus.next_upstream.tries_timeout:"
            " expected a positive, finite number of seconds,"
            " got -1",
        ),
        (
            (*G, "next_upstream", "replay_buffer"),
            -1,
            "upstreams.gpus.next_upstream.replay_buffer: expected an integer >= 0, got -1",
        ),
        (
            (*G, "next_upstream", "retries"),
            2,
            'upstreams.gpus.next_upstream.retries: unknown key; did you mean "tries"?',
        ),
        # health_check
        (
            (*G, "health_check"),
            True,
            "upstreams.gpus.health_check: expected a table, got true",
        ),
        (
            (*G, "health_check", "path"),
            "health",
            'upstreams.gpus.health_check.path: expected a request path starting with "/",'
            ' got "health"',
        ),
        (
            (*G, "health_check", "timeout"),
            5,
            "upstreams.gpus.health_check.timeout: expected timeout (5s) to be less than"
            " interval (5s), so that a check ends before the next one starts; lower timeout"
            " or raise interval",
        ),
        (
            (*G, "health_check", "interval"),
            1.5,
            "upstreams.gpus.health_check.interval: expected timeout (2s) to be less than"
            " interval (1.5s), so that a check ends before the next one starts; lower timeout"
            " or raise interval",
        ),
        (
            (*G, "health_check", "passes"),
            0,
            "upstreams.gpus.health_check.passes: expected a positive integer, got 0",
        ),
        (
            (*G, "health_check", "expect_status"),
            600,
            "upstreams.gpus.health_check.expect_status: expected an HTTP status code in"
            " 100..599, got 600",
        ),
        (
            (*G, "health_check", "expect_status"),
            "200",
            "upstreams.gpus.health_check.expect_status: expected an HTTP status code in"
            ' 100..599, got "200"',
        ),
        # timeouts
        (
            (*G, "timeouts", "first_token"),
            0,
            "upstreams.gpus.timeouts.first_token:"
            " expected a positive, finite number of seconds, got 0",
        ),
        (
            (*G, "timeouts", "idel"),
            30,
            'upstreams.gpus.timeouts.idel: unknown key; did you mean "idle"?',
        ),
        # set_headers
        (
            (*G, "set_headers"),
            ["X-Chat-ID"],
            "upstreams.gpus.set_headers: expected a table of header names to values, e.g."
            ' { "X-Chat-ID" = "$session_key" }, got an array',
        ),
        (
            (*G, "set_headers"),
            {"X Chat": "a"},
            'upstreams.gpus.set_headers."X Chat": expected a header name'
            f' (a token: {TOKEN_CHARS}), got "X Chat"',
        ),
        (
            (*G, "set_headers"),
            {"Content-Length": "0"},
            "upstreams.gpus.set_headers.Content-Length: the proxy manages this header (message"
            " framing or hop-by-hop); remove it from set_headers",
        ),
        (
            (*G, "set_headers"),
            {"X-User": "a", "x-user": "b"},
            'upstreams.gpus.set_headers.x-user: "x-user" is already set by'
            " upstreams.gpus.set_headers.X-User (header names ignore case); keep one",
        ),
        (
            (*G, "set_headers"),
            {"X-User": 5},
            'upstreams.gpus.set_headers.X-User: expected a string, e.g. "$session_key", got 5',
        ),
        (
            (*G, "set_headers"),
            {"X-User": "a\r\nX-Evil: 1"},
            "upstreams.gpus.set_headers.X-User: expected a header value without control"
            ' characters or line breaks, got "a\\r\\nX-Evil: 1"',
        ),
        (
            (*G, "set_headers"),
            {"X-User": "ip=$remote_adr"},
            'upstreams.gpus.set_headers.X-User: unknown variable "$remote_adr" in'
            f' "ip=$remote_adr"; expected {VARIABLES}; did you mean "$remote_addr"?',
        ),
        (
            (*G, "set_headers"),
            {"X-User": "$arg_"},
            'upstreams.gpus.set_headers.X-User: unknown variable "$arg_" in "$arg_"; expected'
            f" {VARIABLES}",
        ),
        (
            (*G, "set_headers"),
            {"X-User": "${arg_user}"},
            'upstreams.gpus.set_headers.X-User: "$" without a variable name in "${arg_user}";'
            f" expected {VARIABLES}",
        ),
        (
            (*G, "set_headers"),
            {"X-Chat-ID": "$session_key"},
            "upstreams.gpus.set_headers.X-Chat-ID: uses $session_key, but the group has no"
            " session sources, so it would always be empty; add [upstreams.gpus.sticky] with"
            ' sources = ["header:X-Chat-ID"] (or another source)',
        ),
        # routes
        (
            ("routes",),
            [{"prefix": "/", "upstream": "gpus", "retry_until_first_event": "yes"}],
            'routes[0].retry_until_first_event: expected true or false (a TOML boolean), got "yes"',
        ),
    ],
)
def test_one_routing_problem(path: tuple[Any, ...], value: Any, message: str) -> None:
    assert problems_of(_set(valid(), path, value)) == [message]


BAD_ROUTING = """\
[[listeners]]
address = "127.0.0.1:8080"

[upstreams.gpus]
servers = [{ address = "127.0.0.1:9001", weight = -1, backup = "yes" }]
balance = "fastest"
set_headers = { "X-Chat-ID" = "$sesion_key" }

[upstreams.gpus.sticky]
sources = ["cookie:chat_session", "jwt:sub"]

[upstreams.gpus.next_upstream]
on = ["error", "http_500"]
tries = 0

[upstreams.gpus.health_check]
path = "/health"
interval = 2
timeout = 3

[[routes]]
prefix = "/v1/"
upstream = "gpus"
retry_until_first_event = 1
"""


def test_all_routing_problems_are_collected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, BAD_ROUTING))
    assert info.value.problems == [
        "upstreams.gpus.servers[0].weight: expected an integer >= 0 (0 drains the server), got -1",
        'upstreams.gpus.servers[0].backup: expected true or false (a TOML boolean), got "yes"',
        'upstreams.gpus.balance: expected "round_robin", "least_streams" or "least_load",'
        ' got "fastest"',
        f'upstreams.gpus.sticky.sources[1]: unknown kind "jwt"; {SOURCE_EXPECTED}, got "jwt:sub"',
        'upstreams.gpus.next_upstream.on[1]: expected "error", "timeout", "http_429",'
        ' "http_502", "http_503" or "http_504", got "http_500"; only 429, 502, 503 and 504'
        " responses can be retried",
        "upstreams.gpus.next_upstream.tries: expected a positive integer, got 0",
        "upstreams.gpus.health_check.timeout: expected timeout (3s) to be less than interval"
        " (2s), so that a check ends before the next one starts; lower timeout or raise"
        " interval",
        'upstreams.gpus.set_headers.X-Chat-ID: unknown variable "$sesion_key" in'
        f' "$sesion_key"; expected {VARIABLES}; did you mean "$session_key"?',
        "routes[0].retry_until_first_event: expected true or false (a TOML boolean), got 1",
    ]


# --- files ------------------------------------------------------------------------------------


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[[listeners]]\naddress = "127.0.0.1:8080"\n[upstreams\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}, line 3, column ")
    assert "invalid TOML: " in problem


def test_toml_syntax_error_gives_the_exact_line_and_column(tmp_path: Path) -> None:
    """The line and column tomllib reports, and its message without the location suffix."""
    path = write(tmp_path, MINIMAL + "\n[timeouts]\nread = 30 s\n")
    line = (MINIMAL + "\n[timeouts]\n").count("\n") + 1
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        f"{path}, line {line}, column 11: invalid TOML:"
        " Expected newline or end of document after a statement"
    ]


def test_toml_error_at_end_of_file_names_the_last_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[[listeners]]\naddress = "127.0.0.1:8080')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        f"{path}, line 2 (end of file): invalid TOML: Unterminated string"
    ]


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
    write_tls_pair(conf)
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
    write_tls_pair(tmp_path, "c.pem", "k.pem")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
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


# --- HTTP/2 settings, nesting, TLS files --------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "range_"),
    [
        ("max_concurrent_streams", "1 to 1000000"),
        ("max_request_head", "1 to 8388608 bytes (8 MiB, Envoy's largest)"),
    ],
)
@pytest.mark.parametrize(
    ("value", "shown"),
    [(2**32, str(2**32)), (2**63, str(2**63)), (10**30, "an integer of 31 digits or more")],
)
def test_limits_sent_as_http2_settings_stay_in_their_range(
    key: str, range_: str, value: int, shown: str
) -> None:
    """RFC 9113 §6.5.1: a SETTINGS value is 32 bits, and one beyond cannot even be encoded;
    these ranges are tighter still (``config/ranges.py``)."""
    data = valid()
    data["limits"] = {key: value}
    top = int(range_.split()[2])
    assert problems_of(data) == [
        f"limits.{key}: expected {range_}, got {shown}; lower it to {top} or less"
    ]
    data["limits"] = {key: top}
    assert getattr(parse_config(data).limits, key) == top


@pytest.mark.parametrize("window", [2**31, 2**32 + 65_535])
def test_connection_window_increment_fits_a_window_update(window: int) -> None:
    data = valid()
    data["limits"] = {"h2_connection_window": window}
    assert problems_of(data) == [
        f"limits.h2_connection_window: expected 65535 to {2**31 - 1} bytes (RFC 9113 §6.9.1:"
        f" a flow-control window), got {window}; lower it to {2**31 - 1} or less"
    ]


@pytest.mark.parametrize(("open_", "close"), [("[", "]"), ("{a = ", "}")])
def test_toml_nested_past_the_recursion_limit_is_a_clean_error(
    tmp_path: Path, open_: str, close: str
) -> None:
    path = write(tmp_path, MINIMAL + "x = " + open_ * 5000 + "1" + close * 5000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        f"{path}: invalid TOML: arrays or inline tables nested too deeply"
    ]


def tls_listener(cert: str, key: str) -> dict[str, Any]:
    data = valid()
    data["listeners"][0].update(tls_cert=cert, tls_key=key)
    return data


def test_swapped_tls_files_are_named(tmp_path: Path) -> None:
    write_tls_pair(tmp_path)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    assert problems_of(tls_listener("key.pem", "cert.pem"), base_dir=str(tmp_path)) == [
        f'listeners[0].tls_cert: "{key}" holds no certificate, but "{cert}" does: the two'
        " files look swapped; give the certificate as tls_cert and the key as tls_key"
    ]
    with pytest.raises(ConfigError) as info:
        parse_quick_config(
            "127.0.0.1:8443", ["127.0.0.1:9001"], tls_cert=str(key), tls_key=str(cert)
        )
    assert info.value.problems == [
        f'--tls-cert: "{key}" holds no certificate, but "{cert}" does: the two'
        " files look swapped; give the certificate as --tls-cert and the key as --tls-key"
    ]


def test_tls_files_without_a_certificate_or_a_key(tmp_path: Path) -> None:
    write_tls_pair(tmp_path)
    (tmp_path / "empty.pem").write_text("")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    assert problems_of(tls_listener("cert.pem", "cert.pem"), base_dir=str(tmp_path)) == [
        f'listeners[0].tls_key: "{cert}" holds no PEM private key (-----BEGIN PRIVATE KEY-----);'
        " found -----BEGIN CERTIFICATE-----"
    ]
    assert problems_of(tls_listener("key.pem", "key.pem"), base_dir=str(tmp_path)) == [
        f'listeners[0].tls_cert: "{key}" holds no PEM certificate (-----BEGIN CERTIFICATE-----);'
        " found -----BEGIN EC PRIVATE KEY-----"
    ]
    empty = tmp_path / "empty.pem"
    assert problems_of(tls_listener("empty.pem", "empty.pem"), base_dir=str(tmp_path)) == [
        f'listeners[0].tls_cert: "{empty}" holds no PEM certificate'
        " (-----BEGIN CERTIFICATE-----); found no PEM block",
        f'listeners[0].tls_key: "{empty}" holds no PEM private key'
        " (-----BEGIN PRIVATE KEY-----); found no PEM block",
    ]


def test_tls_key_of_another_certificate(tmp_path: Path) -> None:
    write_tls_pair(tmp_path)
    write_tls_pair(tmp_path, "other-cert.pem", "other-key.pem")
    cert, other = tmp_path / "cert.pem", tmp_path / "other-key.pem"
    assert problems_of(tls_listener("cert.pem", "other-key.pem"), base_dir=str(tmp_path)) == [
        f'listeners[0].tls_key: the private key in "{other}" does not belong to the'
        f' certificate in "{cert}"'
    ]


def test_encrypted_tls_key_is_refused_without_a_prompt(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    write_tls_pair(tmp_path)
    key = serialization.load_pem_private_key((tmp_path / "key.pem").read_bytes(), None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    (tmp_path / "locked.pem").write_bytes(encrypted)
    locked = tmp_path / "locked.pem"
    assert problems_of(tls_listener("cert.pem", "locked.pem"), base_dir=str(tmp_path)) == [
        f'listeners[0].tls_key: "{locked}" holds an encrypted private key; muxproxy needs it'
        " unencrypted (openssl pkey -in KEY -out PLAIN.pem)"
    ]


def test_unreadable_tls_file_is_named(tmp_path: Path) -> None:
    """A file that exists but cannot be read (``/proc/self/mem`` fails every read from its
    start, whoever the user is)."""
    write_tls_pair(tmp_path)
    unreadable = "/proc/self/mem"
    assert problems_of(tls_listener("cert.pem", unreadable), base_dir=str(tmp_path)) == [
        f'listeners[0].tls_key: cannot read "{unreadable}": Input/output error'
    ]


SENTINEL_STORES = (
    "redis+sentinel://10.0.0.1:26379/mymaster",
    "redis+sentinel://10.0.0.1:26379,10.0.0.2:26380,[::1]:26381/cache/3",
    "redis+sentinel://:pw@sentinel.example:26379/mymaster/0",
)


def test_sentinel_store_urls_are_read_into_their_parts() -> None:
    assert [parse_sentinel(store) for store in SENTINEL_STORES] == [
        SentinelStore((("10.0.0.1", 26379),), "mymaster"),
        SentinelStore((("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381)), "cache", db=3),
        SentinelStore((("sentinel.example", 26379),), "mymaster", db=0, password="pw"),
    ]


def test_resume_takes_true_or_a_table_with_sizes_in_units() -> None:
    data = valid()
    data["routes"] = [
        {"prefix": "/a/", "upstream": "gpus", "resume": True},
        {"prefix": "/b/", "upstream": "gpus", "resume": {"window": "1 MiB", "linger": 5}},
        {"prefix": "/c/", "upstream": "gpus", "resume": {"window": 8192}},
        {"prefix": "/d/", "upstream": "gpus", "resume": {"store": "redis://10.0.0.5:6379/2"}},
        {"prefix": "/e/", "upstream": "gpus", "resume": {"store": "rediss://:pw@cache"}},
        *(
            {"prefix": f"/s{n}/", "upstream": "gpus", "resume": {"store": store}}
            for n, store in enumerate(SENTINEL_STORES)
        ),
    ]
    routes = parse_config(data).routes
    assert [r.resume for r in routes] == [
        Resume(),
        Resume(window=1024 * 1024, linger=5.0),
        Resume(window=8192),
        Resume(store="redis://10.0.0.5:6379/2"),
        Resume(store="rediss://:pw@cache"),
        *(Resume(store=store) for store in SENTINEL_STORES),
    ]
    assert Resume().window == 256 * 1024 and Resume().linger == 30.0


def test_resume_credential_headers_are_lower_cased_once_each() -> None:
    data = valid()
    resume = {"credential_headers": ["X-Api-Key", "x-api-key", "Cookie"], "lease": 3}
    data["routes"] = [{"prefix": "/", "upstream": "gpus", "resume": resume}]
    (route,) = parse_config(data).routes
    assert route.resume == Resume(credential_headers=("x-api-key", "cookie"), lease=3.0)
    assert set(Resume().credential_headers) == {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "cookie",
    }
