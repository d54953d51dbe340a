"""Placement by the engines' KV-cache events, through a group's router: the engine holding
the longest cached prefix of a conversation's known tokens goes first within the load
bounds; every other case is the prefix key's placement, unchanged."""

from __future__ import annotations

from collections.abc import Sequence

from muxproxy.config import AffinityMode, PrefixAffinity, Upstream
from muxproxy.config.kvevents import KvEvents
from muxproxy.config.records import Server
from muxproxy.routing.kvindex import BlockStored
from muxproxy.routing.kvplace import MAX_PENDING, GroupKv
from muxproxy.routing.kvtokens import conversation_keys
from muxproxy.routing.kvwire import encode_batch
from muxproxy.routing.router import GroupRouter

SERVERS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
BLOCK = 4
SYSTEM = {"role": "system", "content": "You are terse."}
FIRST = [SYSTEM, {"role": "user", "content": "hello"}]
SECOND = [*FIRST, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
TOKENS = tuple(range(100, 124))
"""The tokens of FIRST, as the engine's /tokenize would give them: six blocks."""
PREFIX = b"the prefix key"


def group(servers: Sequence[str] = SERVERS, **fields: object) -> Upstream:
    members = tuple(Server(address=address) for address in servers)
    options: dict[str, object] = {
        "affinity": AffinityMode.PREFIX,
        "kv_events": KvEvents(stale_after=2.0),
        "prefix": PrefixAffinity(load_factor=1.25),
    }
    options.update(fields)
    return Upstream(name="g", servers=members, **options)  # type: ignore[arg-type]


def keys(messages: list[dict[str, str]]) -> list[bytes]:
    return conversation_keys({"model": "m", "messages": messages})


def stored(tokens: Sequence[int], first_hash: int = 1) -> list[bytes]:
    """One message: the full blocks of ``tokens`` stored, from the prompt's start."""
    count = len(tokens) // BLOCK
    event = BlockStored(
        block_hashes=tuple(range(first_hash, first_hash + count)),
        parent_block_hash=None,
        token_ids=tuple(tokens[: count * BLOCK]),
        block_size=BLOCK,
    )
    return [b"kv-events", (0).to_bytes(8, "big"), encode_batch(0.0, [event])]


def router_with_cache(holder: int, held: Sequence[int] = TOKENS) -> tuple[GroupRouter, int]:
    """A router whose every feed is up, server ``holder`` holding ``held``, the tokens of
    FIRST known; and the prefix key's first server."""
    router = GroupRouter(group())
    kv = router.kv
    assert kv is not None
    for feed in kv.feeds:
        feed.up(0.0)
    assert kv.feeds[holder].message(stored(held), 0.5) is None
    kv.tokens.put(keys(FIRST)[-1], TOKENS)
    home = router.candidates(None, None, 1.0, PREFIX)[0]
    return router, home


def other_than(index: int) -> int:
    return (index + 1) % len(SERVERS)


def test_the_engine_holding_the_conversation_goes_first_though_the_key_says_another() -> None:
    _, home = router_with_cache(0)
    holder = other_than(home)
    router, home = router_with_cache(holder)
    order = router.candidates(None, None, 1.0, PREFIX, conversation=keys(SECOND))
    assert order[0] == holder != home
    assert sorted(order) == [0, 1, 2]  # the rest stay as fallbacks
    assert router.kv is not None and (router.kv.placed, router.kv.moved) == (1, 1)


def test_the_longest_cached_prefix_wins_and_a_tie_keeps_the_key_order() -> None:
    _, home = router_with_cache(0)
    longer, shorter = other_than(home), other_than(other_than(home))

    def placed(held: dict[int, int]) -> int:
        router = GroupRouter(group())
        assert router.kv is not None
        for index, count in held.items():
            router.kv.feeds[index].up(0.0)
            router.kv.feeds[index].message(stored(TOKENS[:count], 10 * index + 1), 0.5)
        router.kv.tokens.put(keys(FIRST)[-1], TOKENS)
        return router.candidates(None, None, 1.0, PREFIX, conversation=keys(SECOND))[0]

    assert placed({home: 8, longer: 16, shorter: 8}) == longer
    assert placed({home: 8, shorter: 8}) == home
    assert placed({shorter: 4}) == shorter  # one block is a prefix held


def test_unknown_tokens_of_a_later_turn_keep_the_prefix_key_and_ask_for_them_once() -> None:
    router, home = router_with_cache(0)
    router, home = router_with_cache(other_than(home))
    kv = router.kv
    assert kv is not None
    router.stream_started(home, None, 1.0)  # its key's server not the least loaded: still its
    router.stream_started(other_than(home), None, 1.0)
    later = [{"role": "user", "content": "new"}, {"role": "assistant", "content": "hi"}]
    unknown = keys([*later, {"role": "user", "content": "and?"}])
    assert router.candidates(None, None, 1.0, PREFIX, conversation=unknown)[0] == home
    assert kv.placed == 0
    assert kv.ask(unknown) == unknown[-1]
    assert kv.ask(unknown) is None  # in flight already
    assert kv.answered(unknown[-1], (1, 2, 3), "") is False
    assert kv.ask(unknown) is None  # known now
    assert kv.tokens.longest(unknown) == (3, (1, 2, 3))


def test_events_stopped_or_silent_while_busy_fall_back_to_the_prefix_key() -> None:
    _, home = router_with_cache(0)
    holder = other_than(home)
    router, home = router_with_cache(holder)
    kv = router.kv
    assert kv is not None
    conversation = keys(SECOND)
    kv.feeds[holder].failed("ConnectionRefusedError: refused")
    assert router.candidates(None, None, 1.0, PREFIX, conversation=conversation)[0] == home
    kv.feeds[holder].up(1.0)  # back: trusted again, its index kept
    assert router.candidates(None, None, 1.5, PREFIX, conversation=conversation)[0] == holder
    for index in range(3):  # a stream on each: the holder is busy, and within the bounds
        router.stream_started(index, None, 1.5)
    # Silent for more than stale_after while busy: not trusted; within it: trusted.
    assert router.candidates(None, None, 3.6, PREFIX, conversation=conversation)[0] == home
    assert router.candidates(None, None, 2.9, PREFIX, conversation=conversation)[0] == holder


def test_an_engine_over_the_load_bound_is_not_moved_forward() -> None:
    _, home = router_with_cache(0)
    holder = other_than(home)
    router, home = router_with_cache(holder)
    for _ in range(3):  # the mean is 1 stream: 3 is over 1.25 x (3 + 1) / 3
        router.stream_started(holder, None, 1.0)
    kv = router.kv
    assert kv is not None
    kv.feeds[holder].message(stored(TOKENS, first_hash=1), 1.0)  # fresh: trusted while busy
    assert router.candidates(None, None, 1.0, PREFIX, conversation=keys(SECOND))[0] == home


def test_a_group_without_kv_events_has_no_state_and_ignores_conversations() -> None:
    router = GroupRouter(group(kv_events=None))
    assert router.kv is None
    plain = router.candidates(None, None, 1.0, PREFIX)
    assert router.candidates(None, None, 1.0, PREFIX, conversation=keys(SECOND)) == plain
    assert "kv_events" not in router.status(1.0)


def test_a_new_configuration_keeps_the_feeds_of_the_servers_that_stay() -> None:
    router, _ = router_with_cache(1)
    kv = router.kv
    assert kv is not None
    kept = kv.feeds[1]
    new = router.reconfigure(group((SERVERS[1], "10.0.0.9:8000")), 5.0)
    assert new.kv is not None and new.kv.feeds[0] is kept
    assert not new.kv.feeds[1].connected and len(new.kv.feeds[1].blocks) == 0
    assert new.kv.tokens is kv.tokens
    other = new.reconfigure(group((SERVERS[1], "10.0.0.9:8000"), kv_events=KvEvents(port=6000)))
    assert other.kv is not None and other.kv.feeds[0] is not kept  # other engines' endpoints


def test_tokenize_requests_in_flight_are_bounded() -> None:
    kv = GroupKv.of(KvEvents(), 2)
    asked = [kv.ask([bytes([n])]) for n in range(MAX_PENDING + 5)]
    assert sum(key is not None for key in asked) == MAX_PENDING
    assert kv.answered(bytes([0]), None, "status 404") is True  # a failure starts: logged
    assert kv.answered(bytes([1]), None, "status 404") is False
    assert kv.answered(bytes([2]), (7,), "") is True  # it ended: logged
    assert kv.group_status()["tokenize_failures"] == 2


def test_status_shows_each_feed() -> None:
    router, _ = router_with_cache(1)
    status = router.status(1.0)
    servers = status["servers"]
    assert isinstance(servers, list)
    feed = servers[1]["kv_events"]
    assert feed["connected"] and feed["trusted"] and feed["blocks"] == len(TOKENS) // BLOCK
    assert feed["gaps"] == 0 and feed["last_error"] is None
    assert status["kv_events"]["conversations"] == 1  # type: ignore[index]


def test_a_first_turn_goes_to_the_least_loaded_server_while_every_feed_is_trusted() -> None:
    router, home = router_with_cache(0)
    kv = router.kv
    assert kv is not None
    first = keys([SYSTEM, {"role": "user", "content": "a new question"}])
    router.stream_started(home, None, 1.0)  # within the bounds: the key alone keeps it
    router.stream_started(other_than(home), None, 1.0)
    idle = next(i for i in range(len(SERVERS)) if i not in (home, other_than(home)))
    assert router.candidates(None, None, 1.0, PREFIX)[0] == home
    assert router.candidates(None, None, 1.0, PREFIX, conversation=first)[0] == idle
    assert kv.balanced == 1 and kv.placed == 0
    # Its next turn, its tokens not known (forgotten, or not back yet), goes where the
    # first went, though that server is no longer the least loaded.
    router.stream_started(idle, None, 1.0)
    router.stream_started(idle, None, 1.0)
    second = keys([SYSTEM, {"role": "user", "content": "a new question"}, *SECOND[2:]])
    assert router.candidates(None, None, 1.0, PREFIX, conversation=second)[0] == idle
    # A new configuration keeps it, the servers renumbered.
    renumbered = GroupRouter(
        group(servers=(SERVERS[idle], *(a for a in SERVERS if a != SERVERS[idle])))
    )
    assert renumbered.kv is not None
    renumbered.kv.carry(kv, [(idle, 0)])
    assert dict(renumbered.kv.homes) == {first[-1]: 0}
    # One feed silent while busy: not trusted, so the prefix key places it (its later
    # turns, placed by the same key without events, find its history there).
    assert router.candidates(None, None, 10.0, PREFIX, conversation=first)[0] == home
    assert kv.balanced == 1
