"""``[fleet]`` and ``[resolver]``: what loads, and the message each mistake gets."""

from __future__ import annotations

from typing import Any

import pytest

from muxproxy.config import ConfigError, StoreErrorPolicy, parse_config

BASE: dict[str, Any] = {
    "listeners": [{"address": "127.0.0.1:0"}],
    "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
    "routes": [{"prefix": "/", "upstream": "gpus"}],
}


def problems(**sections: Any) -> list[str]:
    try:
        parse_config({**BASE, **sections}, environ={})
    except ConfigError as exc:
        return exc.problems
    return []


def test_without_the_sections_there_is_no_fleet_and_the_system_resolver() -> None:
    config = parse_config(BASE, environ={})
    assert config.fleet is None
    assert config.resolver.nameservers == ()
    assert config.resolver.timeout == 2.0 and config.resolver.attempts == 2


def test_a_fleet_and_a_resolver_load() -> None:
    config = parse_config(
        {
            **BASE,
            "fleet": {
                "store": "redis+sentinel://10.0.0.1:26379/main/2",
                "on_store_error": "closed",
            },
            "resolver": {
                "nameservers": ["10.96.0.10", "127.0.0.1:5353", "[fd00::a]:53", "[::1]"],
                "timeout": 0.5,
                "attempts": 3,
            },
        },
        environ={},
    )
    assert config.fleet is not None
    assert config.fleet.store == "redis+sentinel://10.0.0.1:26379/main/2"
    assert config.fleet.on_store_error is StoreErrorPolicy.CLOSED
    assert config.fleet.sync_interval == 5.0
    assert config.resolver.nameservers == (
        "10.96.0.10:53",
        "127.0.0.1:5353",
        "[fd00::a]:53",
        "[::1]:53",
    )
    assert (config.resolver.timeout, config.resolver.attempts) == (0.5, 3)


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"fleet": {}}, "fleet.store: missing; expected a Redis URL"),
        ({"fleet": {"store": "memcached://x"}}, "fleet.store: expected a Redis URL"),
        (
            {"fleet": {"store": "redis://r:6379", "on_store_error": "Open"}},
            'fleet.on_store_error: expected "local", "open" or "closed", got "Open"; did you'
            ' mean "open"?',
        ),
        ({"fleet": {"store": "redis://r", "sync_interval": 0}}, "fleet.sync_interval: expected"),
        ({"fleet": {"store": "redis://r", "sync": 1}}, "fleet.sync: unknown key; expected one of"),
        ({"resolver": {"nameservers": "10.0.0.1"}}, "resolver.nameservers: expected an array"),
        (
            {"resolver": {"nameservers": ["kube-dns.kube-system"]}},
            "resolver.nameservers[0]: expected an IP address with an optional port",
        ),
        ({"resolver": {"nameservers": ["10.0.0.1:0"]}}, "resolver.nameservers[0]: expected"),
        ({"resolver": {"nameservers": ["10.0.0.1:53x"]}}, "resolver.nameservers[0]: expected"),
        ({"resolver": {"attempts": 0}}, "resolver.attempts: expected"),
        ({"resolver": {"attempts": 11}}, "resolver.attempts: expected 1 to 10"),
        ({"resolver": {"timeout": 61}}, "resolver.timeout: expected"),
    ],
)
def test_each_mistake_names_its_key(sections: dict[str, Any], expected: str) -> None:
    found = problems(**sections)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_the_store_from_the_environment_wins_over_the_file() -> None:
    environ = {"MUXPROXY_FLEET_STORE": "rediss://:secret@redis:6380/1"}
    config = parse_config(
        {**BASE, "fleet": {"store": "redis://other:6379", "sync_interval": 2}}, environ=environ
    )
    assert config.fleet is not None
    assert config.fleet.store == "rediss://:secret@redis:6380/1"
    assert config.fleet.sync_interval == 2


def test_the_store_from_the_environment_makes_a_fleet_of_the_defaults() -> None:
    config = parse_config(BASE, environ={"MUXPROXY_FLEET_STORE": "redis://redis:6379/0"})
    assert config.fleet is not None and config.fleet.store == "redis://redis:6379/0"
    assert config.fleet.on_store_error is StoreErrorPolicy.LOCAL


def test_a_bad_store_in_the_environment_names_the_variable() -> None:
    try:
        parse_config(BASE, environ={"MUXPROXY_FLEET_STORE": "redis//nohost"})
    except ConfigError as exc:
        assert len(exc.problems) == 1
        assert exc.problems[0].startswith("MUXPROXY_FLEET_STORE: expected a Redis URL")
    else:
        raise AssertionError("a malformed MUXPROXY_FLEET_STORE was accepted")
