"""The configuration of LLM-aware balancing and admission: least load, prefix affinity, load
reports, server limits, the queue, tenants, priorities and budgets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from muxproxy.config import (
    AdmissionQueue,
    AffinityMode,
    Balance,
    ConfigError,
    LoadReporting,
    PrefixAffinity,
    RateLimit,
    SessionSource,
    load_config,
    parse_config,
)

FILE = """\
[[listeners]]
address = "127.0.0.1:8080"

[upstreams.gpus]
servers = [
  { address = "127.0.0.1:9001", max_streams = 64, max_waiting = 4 },
  { address = "127.0.0.1:9002", max_streams = 32 },
]
balance = "least_load"
affinity = "prefix"
default_max_tokens = 512
prefix = { source = "messages", length = 2048, load_factor = 1.5, balance_gap = 2 }
load_report = { path = "/metrics", interval = 0.5, kv_cache_limit = 0.9 }
queue = { max = 200, timeout = 20, retry_after = 2, affinity_wait = 0 }
tenant = "header:Authorization"
priority = "header:X-Priority"
rate_limit = { tokens_per_minute = 100000, requests_per_minute = 600 }
"""


def test_every_key(tmp_path: Path) -> None:
    path = tmp_path / "muxproxy.toml"
    path.write_text(FILE)
    group = load_config(path).upstreams["gpus"]
    assert [(s.max_streams, s.max_waiting) for s in group.servers] == [(64, 4), (32, None)]
    assert group.balance is Balance.LEAST_LOAD and group.affinity is AffinityMode.PREFIX
    assert group.default_max_tokens == 512
    assert group.prefix == PrefixAffinity(
        source="messages", length=2048, load_factor=1.5, balance_gap=2
    )
    assert group.load_report == LoadReporting(path="/metrics", interval=0.5, kv_cache_limit=0.9)
    assert group.load_report.poll_timeout == pytest.approx(0.4)
    assert group.queue == AdmissionQueue(max=200, timeout=20.0, retry_after=2, affinity_wait=0.0)
    assert group.tenant == SessionSource(kind="header", name="authorization")
    assert group.priority == SessionSource(kind="header", name="x-priority")
    assert group.rate_limit == RateLimit(tokens_per_minute=100000, requests_per_minute=600)
    assert group.reads_body and group.admission and group.admits


def valid(**group: Any) -> dict[str, Any]:
    return {
        "listeners": [{"address": "127.0.0.1:8080"}],
        "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"], **group}},
    }


def test_defaults_leave_every_request_on_the_plain_path() -> None:
    group = parse_config(valid()).upstreams["gpus"]
    assert group.affinity is AffinityMode.NONE and group.load_report is None
    assert group.queue == AdmissionQueue(max=1000, timeout=30.0, retry_after=1)
    assert group.tenant is None and group.priority is None and group.rate_limit is None
    assert not (group.reads_body or group.admission or group.admits)


def test_tables_alone_get_their_defaults() -> None:
    group = parse_config(valid(prefix={}, load_report={}, queue={})).upstreams["gpus"]
    assert group.prefix == PrefixAffinity()
    assert group.load_report == LoadReporting()
    assert group.queue == AdmissionQueue()


def test_prefix_affinity_reads_the_engines_reports_unless_told_not_to() -> None:
    group = parse_config(valid(affinity="prefix")).upstreams["gpus"]
    assert group.load_report == LoadReporting()  # its engines' room keeps keys home
    off = parse_config(valid(affinity="prefix", load_report=False)).upstreams["gpus"]
    assert off.load_report is None
    own = parse_config(valid(affinity="prefix", load_report={"interval": 2})).upstreams["gpus"]
    assert own.load_report == LoadReporting(interval=2.0)
    plain = parse_config(valid(load_report=False)).upstreams["gpus"]
    assert plain.load_report is None


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (
            {"balance": "least_loaded"},
            'upstreams.gpus.balance: expected "round_robin", "least_streams" or "least_load",'
            ' got "least_loaded"; did you mean "least_load"?',
        ),
        (
            {"affinity": "prefixes"},
            'upstreams.gpus.affinity: expected "none" or "prefix", got "prefixes";'
            ' did you mean "prefix"?',
        ),
        (
            {"prefix": {"load_factor": 0.5}},
            "upstreams.gpus.prefix.load_factor: expected a number from 1 to 100 (a server takes a"
            " new prefix while its streams are under load_factor x the mean; 1.25 is usual),"
            " got 0.5",
        ),
        (
            {"prefix": {"balance_gap": 0}},
            "upstreams.gpus.prefix.balance_gap: expected an integer >= 1 (a server takes a new"
            " prefix only while within balance_gap streams of the least loaded one; about a"
            " quarter of an engine's batch slots is usual), got 0",
        ),
        (
            {"prefix": {"source": "system"}},
            'upstreams.gpus.prefix.source: expected "auto", "messages" or "prompt", got "system"',
        ),
        (
            {"load_report": {"interval": 1, "timeout": 2}},
            "upstreams.gpus.load_report.timeout: expected timeout (2s) to be less than interval"
            " (1s), so that a poll ends before the next one starts; lower timeout or raise"
            " interval",
        ),
        (
            {"load_report": {"kv_cache_limit": 95}},
            "upstreams.gpus.load_report.kv_cache_limit: expected a fraction in (0, 1], e.g."
            " 0.95, got 95",
        ),
        (
            {"queue": {"max": -1}},
            "upstreams.gpus.queue.max: expected an integer >= 0, got -1",
        ),
        (
            {"queue": {"affinity_wait": -1}},
            "upstreams.gpus.queue.affinity_wait: expected 0 (off) or a positive, finite number of"
            " seconds, got -1",
        ),
        (
            {"rate_limit": {}},
            "upstreams.gpus.rate_limit: sets no budget; expected tokens_per_minute = N,"
            " requests_per_minute = M and/or max_concurrent = C, or remove rate_limit",
        ),
        (
            {"tenant": "jwt:sub"},
            'upstreams.gpus.tenant: unknown kind "jwt"; expected "kind:name" with kind cookie,'
            ' header, query or body, e.g. "header:X-Chat-ID", got "jwt:sub"',
        ),
        (
            {"servers": [{"address": "127.0.0.1:9001", "max_waiting": 2}]},
            "upstreams.gpus.servers[0].max_waiting: counts the requests the engine reports"
            " waiting, but the group has no load reports; add upstreams.gpus.load_report ="
            ' { path = "/metrics" } or remove max_waiting',
        ),
        (
            {"servers": [{"address": "127.0.0.1:9001", "max_streams": 0}]},
            "upstreams.gpus.servers[0].max_streams: expected a positive integer, got 0",
        ),
    ],
)
def test_one_problem(group: dict[str, Any], message: str) -> None:
    assert problems(valid(**group)) == [message]


# -- the queue's deadline per priority class -----------------------------------------------


def test_max_wait_gives_named_classes_their_deadline_and_the_rest_the_timeout() -> None:
    queue = {"timeout": 20, "max_wait": {"0": 60, "5": "1.5s", "9": "500ms", "3": "2m"}}
    found = parse_config(valid(queue=queue)).upstreams["gpus"].queue
    assert found.max_wait == ((0, 60.0), (3, 120.0), (5, 1.5), (9, 0.5))
    assert [found.wait_for(level) for level in range(10)] == [
        60.0, 20.0, 20.0, 120.0, 20.0, 1.5, 20.0, 20.0, 20.0, 0.5
    ]  # fmt: skip
    assert AdmissionQueue().wait_for(9) == 30.0  # none named: queue.timeout for every class


@pytest.mark.parametrize(
    ("max_wait", "message"),
    [
        (
            {"10": 5},
            "upstreams.gpus.queue.max_wait.10: expected a priority class 0..9 as the key",
        ),
        (
            {"09": 5},
            "upstreams.gpus.queue.max_wait.09: expected a priority class 0..9 as the key",
        ),
        (
            {"high": 5},
            "upstreams.gpus.queue.max_wait.high: expected a priority class 0..9 as the key",
        ),
        (
            {"9": 0},
            "upstreams.gpus.queue.max_wait.9: expected more than 0 and at most 86400 seconds"
            " (a day), got 0.0; raise it above 0",
        ),
        (
            {"9": "2d"},
            "upstreams.gpus.queue.max_wait.9: expected seconds (a number) or a duration such as"
            ' "30s", "500ms" or "2m", got "2d"',
        ),
        (
            {"1": 86401},
            "upstreams.gpus.queue.max_wait.1: expected more than 0 and at most 86400 seconds"
            " (a day), got 86401.0; lower it to 86400 or less",
        ),
        (
            {"1": 10**400},
            "upstreams.gpus.queue.max_wait.1: expected a finite number, more than 0 and at most"
            " 86400 seconds (a day), got inf",
        ),
        (
            {"1": True},
            "upstreams.gpus.queue.max_wait.1: expected seconds (a number) or a duration such as"
            ' "30s", "500ms" or "2m", got true',
        ),
        (
            30,
            "upstreams.gpus.queue.max_wait: expected a table of priority classes, e.g."
            ' { 0 = 60, 9 = "2s" }, got 30',
        ),
    ],
)
def test_a_bad_max_wait_is_refused_naming_its_class(max_wait: Any, message: str) -> None:
    assert problems(valid(queue={"max_wait": max_wait})) == [message]
