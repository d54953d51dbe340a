"""A group's ``discover`` table and ``slow_start``: what loads, and each mistake's message."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from muxproxy.config import ConfigError, Server, parse_config
from muxproxy.config.discovery import Discover, RecordKind


def config_of(group: dict[str, Any]) -> Any:
    return parse_config(
        {
            "listeners": [{"address": "127.0.0.1:0"}],
            "upstreams": {"gpus": group},
            "routes": [{"prefix": "/", "upstream": "gpus"}],
        },
        environ={},
    )


def problems(group: dict[str, Any]) -> list[str]:
    try:
        config_of(group)
    except ConfigError as exc:
        return exc.problems
    return []


def test_a_dns_group_loads_with_the_servers_settings_and_no_servers_yet() -> None:
    group = config_of(
        {
            "discover": {
                "dns": "vllm.llm.svc.cluster.local",
                "port": 8000,
                "protocol": "h2",
                "max_streams": 64,
                "interval": 2,
            },
            "slow_start": "30s",
        }
    ).upstreams["gpus"]
    assert group.servers == ()
    assert group.discover == Discover(
        dns="vllm.llm.svc.cluster.local", port=8000, protocol="h2", max_streams=64, interval=2.0
    )
    assert group.discover.kind is RecordKind.ADDRESS
    assert group.slow_start == 30.0
    assert group.admission  # max_streams of discovered servers makes requests admitted


def test_an_srv_group_loads() -> None:
    group = config_of({"discover": {"srv": "_http._tcp.vllm.example."}}).upstreams["gpus"]
    assert group.discover is not None and group.discover.kind is RecordKind.SRV
    assert group.discover.name == "_http._tcp.vllm.example."
    assert group.slow_start == 0.0


@pytest.mark.parametrize(
    ("text", "seconds"), [(0, 0.0), (12.5, 12.5), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0)]
)
def test_slow_start_takes_seconds_or_a_duration(text: Any, seconds: float) -> None:
    group = config_of({"servers": ["127.0.0.1:9001"], "slow_start": text}).upstreams["gpus"]
    assert group.slow_start == seconds


def test_discover_has_every_server_setting_but_address_backup_and_kv_events() -> None:
    server = {f.name for f in attrs.fields(Server)} - {"address", "backup", "kv_events"}
    discover = {f.name: f.default for f in attrs.fields(Discover)}
    assert server <= set(discover)
    for field in attrs.fields(Server):
        if field.name in server:
            assert discover[field.name] == field.default, field.name


DNS = {"dns": "vllm.example", "port": 8000}


@pytest.mark.parametrize(
    ("group", "expected"),
    [
        (
            {"servers": ["127.0.0.1:9001"], "discover": DNS},
            "upstreams.gpus: servers and discover are both set; keep one: servers lists the"
            " servers, discover finds them in DNS",
        ),
        (
            {"discover": {"port": 8000}},
            "upstreams.gpus.discover: expected exactly one of dns (A and AAAA records, with"
            " port) and srv (SRV records), got neither",
        ),
        (
            {"discover": {**DNS, "srv": "_http._tcp.vllm.example"}},
            "upstreams.gpus.discover: expected exactly one of dns (A and AAAA records, with"
            " port) and srv (SRV records), got both",
        ),
        (
            {"discover": {"dns": "vllm.example"}},
            "upstreams.gpus.discover.port: missing; dns gives addresses, port says where: 8000",
        ),
        (
            {"discover": {"srv": "_http._tcp.vllm.example", "port": 80}},
            "upstreams.gpus.discover.port: SRV records carry the servers' ports; remove port,"
            " or look up A and AAAA records with dns = NAME",
        ),
        (
            {"discover": {"srv": "_http._tcp.vllm.example", "weight": 2}},
            "upstreams.gpus.discover.weight: SRV records carry the servers' weights; remove"
            " weight, or look up A and AAAA records with dns = NAME",
        ),
        (
            {"discover": {"dns": "not a name", "port": 8000}},
            "upstreams.gpus.discover.dns: expected a DNS name such as"
            ' "vllm.llm.svc.cluster.local" (labels of letters, digits, - and _, 63 characters'
            ' each at most), got "not a name"',
        ),
        (
            {"discover": {**DNS, "port": 70000}},
            "upstreams.gpus.discover.port: expected 1 to 65535 (a TCP port), got 70000; lower"
            " it to 65535 or less",
        ),
        (
            {"discover": {**DNS, "interval": 0.5}},
            "upstreams.gpus.discover.interval: expected 1 to 3600 seconds (an hour; at least a"
            " second), got 0.5; raise it to 1 or more",
        ),
        (
            {"discover": {**DNS, "backup": True}},
            'upstreams.gpus.discover.backup: unknown key; "backup" belongs in a server\'s'
            ' table: upstreams.gpus.servers = [{ address = "...", backup = ... }]',
        ),
        (
            {"discover": {**DNS, "max_waiting": 4}},
            "upstreams.gpus.discover.max_waiting: counts the requests the engine reports"
            " waiting, but the group has no load reports; add upstreams.gpus.load_report ="
            ' { path = "/metrics" } or remove it',
        ),
        (
            {"servers": ["127.0.0.1:9001"], "slow_start": "soon"},
            "upstreams.gpus.slow_start: expected seconds (a number >= 0, 0: off) or a duration"
            ' such as "30s", "500ms" or "2m", got "soon"',
        ),
        (
            {"servers": ["127.0.0.1:9001"], "slow_start": "2h"},
            "upstreams.gpus.slow_start: expected 0 to 3600 seconds (an hour), got 7200.0;"
            " lower it to 3600 or less",
        ),
    ],
)
def test_each_mistake_names_its_key(group: dict[str, Any], expected: str) -> None:
    assert problems(group) == [expected]
