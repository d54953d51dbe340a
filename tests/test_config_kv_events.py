"""The ``kv_events`` table of a group and a server's own ``kv_events`` endpoint: values,
defaults, bounds and the cross-checks with ``affinity``."""

from __future__ import annotations

from typing import Any

import pytest

from muxproxy.config import ConfigError, parse_config
from muxproxy.config.kvevents import KvEvents, endpoint_host_port


def config(**group: Any) -> dict[str, Any]:
    return {
        "listeners": [{"address": "127.0.0.1:8080"}],
        "upstreams": {"gpus": {"servers": ["10.0.0.1:8000", "10.0.0.2:8000"], **group}},
    }


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_every_key_and_a_servers_own_endpoint() -> None:
    group = parse_config(
        config(
            affinity="prefix",
            servers=[
                "10.0.0.1:8000",
                {"address": "10.0.0.2:8000", "kv_events": "tcp://[::1]:6000"},
            ],
            kv_events={"port": 5600, "topic": "kv", "stale_after": "500ms", "max_blocks": 1000},
        )
    ).upstreams["gpus"]
    assert group.kv_events == KvEvents(port=5600, topic="kv", stale_after=0.5, max_blocks=1000)
    assert [s.kv_events for s in group.servers] == [None, "tcp://[::1]:6000"]
    assert endpoint_host_port("tcp://[::1]:6000") == ("::1", 6000)


def test_the_table_alone_gets_its_defaults_and_groups_without_it_none() -> None:
    on = parse_config(config(affinity="prefix", kv_events={})).upstreams["gpus"]
    assert on.kv_events == KvEvents(port=5557, topic="kv-events", stale_after=2.0)
    assert parse_config(config(affinity="prefix")).upstreams["gpus"].kv_events is None


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (
            {"kv_events": {}},
            'upstreams.gpus.kv_events: reorders the placement of affinity = "prefix" by the'
            " engines' KV-cache events, but the group's affinity is \"none\"; add"
            ' upstreams.gpus.affinity = "prefix" or remove kv_events',
        ),
        (
            {
                "affinity": "prefix",
                "servers": [{"address": "10.0.0.1:8000", "kv_events": "tcp://h:1"}],
            },
            "upstreams.gpus.servers[0].kv_events: names where the engine publishes its KV-cache"
            " events, but the group does not follow them; add upstreams.gpus.kv_events ="
            ' { port = 5557 } (and affinity = "prefix") or remove it',
        ),
        (
            {"affinity": "prefix", "kv_events": {"port": 70000}},
            "upstreams.gpus.kv_events.port: expected 1 to 65535 (a TCP port), got 70000; lower it"
            " to 65535 or less",
        ),
        (
            {"affinity": "prefix", "kv_events": {"stale_after": 0}},
            'upstreams.gpus.kv_events.stale_after: expected seconds above 0 (e.g. 2 or "2s"),'
            " got 0",
        ),
        (
            {"affinity": "prefix", "kv_events": {"max_blocks": 0}},
            "upstreams.gpus.kv_events.max_blocks: expected a positive integer, got 0",
        ),
        (
            {
                "affinity": "prefix",
                "kv_events": {},
                "servers": [{"address": "10.0.0.1:8000", "kv_events": "10.0.0.1:5557"}],
            },
            'upstreams.gpus.servers[0].kv_events: expected a ZeroMQ endpoint "tcp://host:port"'
            ' where the engine publishes its KV-cache events, got "10.0.0.1:5557"',
        ),
        (
            {"affinity": "prefix", "kv_events": {"endpoint": "tcp://*:5557"}},
            "upstreams.gpus.kv_events.endpoint: unknown key; expected one of: port, topic,"
            " stale_after, max_blocks",
        ),
    ],
)
def test_one_problem_names_the_key_and_the_fix(group: dict[str, Any], message: str) -> None:
    assert problems(config(**group)) == [message]
