"""The core's side of the engines' KV-cache events: what it asks the driver to follow, what
the answers do to the group's router, and what it logs."""

from __future__ import annotations

import json
from collections.abc import Sequence

from muxproxy.config import Config, parse_config
from muxproxy.core.commands import KvEndpoint, KvFollow, Log
from muxproxy.core.events import (
    ConfigChanged,
    KvEventsReceived,
    KvSubscription,
    KvTokensAnswered,
)
from muxproxy.core.proxy import ProxyCore
from muxproxy.routing.kvindex import BlockStored
from muxproxy.routing.kvwire import encode_batch

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def config(kv_events: bool = True, servers: int = 2) -> Config:
    group: dict[str, object] = {
        "servers": [A, {"address": B, "kv_events": "tcp://10.0.0.9:6000"}][:servers],
        "affinity": "prefix",
    }
    if kv_events:
        group["kv_events"] = {"topic": "kv"}
    return parse_config(
        {"listeners": [{"address": "127.0.0.1:8080"}], "upstreams": {"gpus": group}}
    )


def follows(commands: Sequence[object]) -> list[KvFollow]:
    return [c for c in commands if isinstance(c, KvFollow)]


def message(sequence: int) -> tuple[bytes, ...]:
    event = BlockStored(
        block_hashes=(1, 2), parent_block_hash=None, token_ids=tuple(range(8)), block_size=4
    )
    return (b"kv", sequence.to_bytes(8, "big"), encode_batch(0.0, [event]))


def test_a_configuration_names_every_endpoint_and_one_without_stops_them() -> None:
    core = ProxyCore(config(), raise_errors=True)
    assert follows(core.handle(ConfigChanged(now=0.0, config=core.config))) == [
        KvFollow(
            endpoints=(
                KvEndpoint(group="gpus", address=A, host="10.0.0.1", port=5557, topic=b"kv"),
                KvEndpoint(group="gpus", address=B, host="10.0.0.9", port=6000, topic=b"kv"),
            )
        )
    ]
    plain = config(kv_events=False, servers=1)
    assert follows(core.handle(ConfigChanged(now=1.0, config=plain))) == [KvFollow(endpoints=())]
    assert follows(core.handle(ConfigChanged(now=2.0, config=plain))) == []  # nothing to stop


def test_subscriptions_and_messages_reach_the_servers_feed_and_notes_are_logged_sparingly() -> None:
    core = ProxyCore(config(), raise_errors=True)
    core.handle(ConfigChanged(now=0.0, config=core.config))
    router = core.router(core.config.upstreams["gpus"])
    assert router.kv is not None
    feed = router.kv.feeds[1]
    core.handle(KvSubscription(now=1.0, group="gpus", address=B))
    assert core.handle(KvEventsReceived(now=1.5, group="gpus", address=B, parts=message(0))) == []
    assert feed.connected and len(feed.blocks) == 2
    gap = core.handle(KvEventsReceived(now=2.0, group="gpus", address=B, parts=message(5)))
    assert [c.event for c in gap if isinstance(c, Log)] == ["kv_events"]
    again = core.handle(KvEventsReceived(now=3.0, group="gpus", address=B, parts=message(9)))
    assert again == [] and feed.gaps == 2  # counted, logged once a minute
    core.handle(KvSubscription(now=4.0, group="gpus", address=B, error="OSError: refused"))
    assert not feed.connected and feed.last_error == "OSError: refused"
    # A server or group that is not configured: dropped.
    core.handle(KvEventsReceived(now=5.0, group="gpus", address="10.0.0.3:8000", parts=message(0)))
    core.handle(KvEventsReceived(now=5.0, group="other", address=A, parts=message(0)))
    assert len(router.kv.feeds[0].blocks) == 0


def test_tokenize_answers_fill_the_tokens_and_a_failure_is_logged_when_it_starts_and_ends() -> None:
    core = ProxyCore(config(), raise_errors=True)
    core.handle(ConfigChanged(now=0.0, config=core.config))
    router = core.router(core.config.upstreams["gpus"])
    kv = router.kv
    assert kv is not None
    for key in (b"a", b"b", b"c"):
        assert kv.ask([key]) == key

    def answer(key: bytes, body: bytes | None, error: str = "") -> list[str]:
        event = KvTokensAnswered(now=1.0, group="gpus", key=key, body=body, error=error)
        return [str(c.fields["detail"]) for c in core.handle(event) if isinstance(c, Log)]

    assert answer(b"a", json.dumps({"tokens": [1, 2, 3]}).encode()) == []
    assert kv.tokens.longest([b"a"]) == (1, (1, 2, 3))
    assert answer(b"b", b"{}") == ["the tokenize answer has no tokens list"]
    assert answer(b"c", None, "status 404") == []  # still failing: not logged again
    assert kv.ask([b"d"]) == b"d"
    assert answer(b"d", b'{"tokens": [4]}') == ["ok"]
    assert kv.pending == set()
